"""`python -m benchmarks fuzz`: random and mutated requests to real stage workers and to the coordinator's REST API.

Stage service: two `swarm peer --config` processes (stage 0 and the last stage of the config, with
a 4 MB gRPC message limit) get `--cases` requests drawn by hypothesis (`stage_calls`): valid
Forward, Backward, Info and Parameters requests (token ids and hidden states of any float dtype and
codec, holding NaN, Inf, huge or tiny values), mutated field by field (run id, stage, step, loss
scale, microbatch id; a tensor's dtype, codec, shape with dimensions up to +-2^63, its payload cut,
padded past the message limit, replaced or bit-flipped) or byte by byte once serialised, or
plain random bytes, and sent to any of the four methods; one call in four goes together with a good
Forward to the same worker (the worker may batch the two). Every answer must be OK (a response that
parses, its tensors well-formed) or a refusal with a status in CLEAN and a message, and the good
Forward must be served: UNKNOWN and INTERNAL (what an unhandled exception gives), UNAVAILABLE (the
server gone) or a worker process that exits count as failures. Afterwards each worker must still
answer a good Forward with what a local `Stage` holding the weights it serves (Parameters)
computes, and those weights are finite (fuzzed training requests made it take optimizer steps).

REST API: a coordinator gets `--cases` requests drawn by schemathesis from its /openapi.json,
spread over its operations, with data the schema allows and, where an operation has parameters,
data it does not. A 5xx answer, a dropped connection or a coordinator that exits count as failures. Afterwards
/api/v1/state, /api/v1/join and /metrics must still answer 200.

The test suite runs the same fuzz with fewer cases (tests/test_fuzz.py, tests/test_coordinator_api.py;
`SWARM_FUZZ_EXAMPLES` sets how many).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm.client import StageClient, grpc_options
from swarm.config import RunConfig, dump_config, load_config
from swarm.model import Stage
from swarm.rpc import method_path, pb
from swarm.wire import CODECS, DTYPES, WireError, check, decode, encode

SECTION = "fuzz: random and mutated requests to a stage worker's gRPC service and to the coordinator's REST API"
MAX_MESSAGE_MB = 4

# A refusal: the request was wrong, or could not be served now. Anything else is a server fault.
CLEAN = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.ABORTED,
    }
)
RESPONSES: dict[str, type[Message]] = {
    "Forward": pb.ForwardResponse,
    "Backward": pb.BackwardResponse,
    "Info": pb.InfoResponse,
    "Parameters": pb.ParametersResponse,
}
REQUESTS: dict[str, type[Message]] = {
    "Forward": pb.ForwardRequest,
    "Backward": pb.BackwardRequest,
    "Info": pb.InfoRequest,
    "Parameters": pb.ParametersRequest,
}


def examples(default: int) -> int:
    """How many examples a fuzz test draws: $SWARM_FUZZ_EXAMPLES, else `default`."""
    return int(os.environ.get("SWARM_FUZZ_EXAMPLES") or default)


def fuzz_run(base: RunConfig) -> RunConfig:
    """`base` with a 4 MB message limit (oversized requests cost little to build) and a 0.5 s wait for
    the stage's sample count (a request for the next step waits that long on a lone worker)."""
    return base.model_copy(
        update={
            "wire": base.wire.model_copy(update={"max_message_mb": MAX_MESSAGE_MB}),
            "averaging": base.averaging.model_copy(update={"sync_timeout_s": 0.5}),
        }
    )


def write_config(run: RunConfig, folder: Path) -> Path:
    path = folder / "fuzz.toml"
    path.write_text(dump_config(run))
    assert load_config(path) == run
    return path


# -- drawing requests ------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """One request: which worker ('first' or 'last' stage), which method, the bytes sent; and whether a
    good Forward goes to the same worker at the same time (the two may be batched together)."""

    worker: str
    method: str
    payload: bytes = field(repr=False)
    alongside: bool = False

    def __repr__(self) -> str:  # hypothesis prints the failing call: not megabytes of it
        head = self.payload[:160].hex() + ("..." if len(self.payload) > 160 else "")
        return f"Call({self.worker!r}, {self.method!r}, {len(self.payload)} bytes: {head}, alongside={self.alongside})"

    def _repr_pretty_(self, printer, cycle) -> None:  # what hypothesis's printer calls on a dataclass
        printer.text(repr(self))


TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)  # protobuf strings are UTF-8
BAD_DTYPES = ["", "float64", "uint8", "int8", "bool", "complex64", "float8_e4m3fn", "FLOAT32"]
BAD_CODECS = ["", "gzip", "NONE", "int4", "fp8"]


def dimensions(run: RunConfig) -> st.SearchStrategy[int]:
    m = run.model
    special = [0, 1, 2, 3, -1, m.seq_len, m.seq_len + 1, m.d_model, m.vocab_size, run.serve.max_batch + 1]
    special += [2**31 - 1, 2**31, 2**32, 2**62, 2**63 - 1, -(2**63)]
    return st.sampled_from(special) | st.integers(-(2**63), 2**63 - 1)


@st.composite
def sizes(draw, run: RunConfig) -> tuple[int, int]:
    """Batch and sequence length: small mostly, now and then the largest allowed or one beyond."""
    if draw(st.integers(0, 15)):
        return draw(st.integers(1, 4)), draw(st.integers(1, 16))
    m = run.serve.max_batch
    return draw(st.sampled_from([0, 1, m, m + 1])), draw(
        st.sampled_from([0, 1, run.model.seq_len, run.model.seq_len + 1])
    )


@st.composite
def floats_msg(draw, shape: tuple[int, ...]) -> pb.Tensor:
    """A well-formed float tensor of any dtype and codec, its values normal, tiny or huge, maybe NaN or Inf."""
    seed = draw(st.integers(0, 2**16))
    scale = draw(st.sampled_from([1.0, 1.0, 1.0, 1e-30, 1e4, 1e30, 3e38]))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale
    poke = draw(st.sampled_from([None, None, None, math.nan, math.inf, -math.inf]))
    if poke is not None and x.numel():
        x.view(-1)[draw(st.integers(0, x.numel() - 1))] = poke
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    return encode(x.to(dtype), draw(st.sampled_from(CODECS)))


@st.composite
def ids_msg(draw, run: RunConfig, shape: tuple[int, int]) -> pb.Tensor:
    """Token ids, int64 or int32, now and then one out of the vocabulary."""
    ids = torch.randint(
        0, run.model.vocab_size, shape, generator=torch.Generator().manual_seed(draw(st.integers(0, 999)))
    )
    poke = draw(st.sampled_from([None, None, None, None, -1, run.model.vocab_size, 2**31 - 1]))
    if poke is not None and ids.numel():
        ids.view(-1)[draw(st.integers(0, ids.numel() - 1))] = poke
    return encode(ids.to(draw(st.sampled_from([torch.int64, torch.int32]))))


@st.composite
def valid_request(draw, run: RunConfig, worker: str, method: str) -> Message:
    """A request of the right form for `worker` (values may still be out of range: NaN, ids, sizes)."""
    last = run.stages.count - 1
    stage = 0 if worker == "first" else last
    common = {"run_id": run.run_id, "stage": stage}
    if method == "Info":
        return pb.InfoRequest()
    if method == "Parameters":
        return pb.ParametersRequest(**common, with_grads=draw(st.booleans()))
    b, t = draw(sizes(run))
    stage_input = draw(ids_msg(run, (b, t))) if worker == "first" else draw(floats_msg((b, t, run.model.d_model)))
    # A few microbatch ids only, so that backwards meet the forwards recorded in the worker's cache.
    common |= {
        "microbatch_id": draw(st.sampled_from(["mb0", "mb1", "mb2"])),
        "step": draw(st.sampled_from([0, 0, 1, 2])),
    }
    if method == "Forward":
        req = pb.ForwardRequest(**common, input=stage_input, train=draw(st.booleans()))
        if worker == "last" and draw(st.booleans()):
            req.targets.CopyFrom(draw(ids_msg(run, (b, t))))
            req.loss_scale = draw(st.sampled_from([0.0, 0.0, 0.5, 1.0]))
        return req
    width = run.model.vocab_size if worker == "last" else run.model.d_model
    return pb.BackwardRequest(**common, input=stage_input, output_grad=draw(floats_msg((b, t, width))))


@st.composite
def mutate_tensor(draw, msg: pb.Tensor, run: RunConfig) -> None:
    what = draw(st.sampled_from(["dtype", "codec", "shape", "dim", "cut", "pad", "oversize", "bytes", "flip", "clear"]))
    if what == "dtype":
        msg.dtype = draw(st.sampled_from([*DTYPES, *BAD_DTYPES]) | TEXT)
    elif what == "codec":
        msg.codec = draw(st.sampled_from([*CODECS, *BAD_CODECS]) | TEXT)
    elif what == "shape":
        del msg.shape[:]
        msg.shape.extend(draw(st.lists(dimensions(run), max_size=6)))
    elif what == "dim" and msg.shape:
        msg.shape[draw(st.integers(0, len(msg.shape) - 1))] = draw(dimensions(run))
    elif what == "cut":
        msg.data = msg.data[: draw(st.integers(0, max(0, len(msg.data) - 1)))]
    elif what == "pad":
        msg.data += draw(st.binary(min_size=1, max_size=64))
    elif what == "oversize":  # up to past the message limit
        limit = MAX_MESSAGE_MB * 2**20
        msg.data += bytes(draw(st.sampled_from([2**20, limit - 2**16, limit, limit + 2**20]) | st.integers(1, limit)))
    elif what == "bytes":
        msg.data = draw(st.binary(max_size=512))
    elif what == "flip" and msg.data:
        data = bytearray(msg.data)
        data[draw(st.integers(0, len(data) - 1))] ^= draw(st.integers(1, 255))
        msg.data = bytes(data)
    elif what == "clear":
        msg.Clear()


@st.composite
def mutate(draw, msg: Message, run: RunConfig) -> None:
    """Change one field of `msg` to anything its type allows."""
    fields = list(msg.DESCRIPTOR.fields)
    if not fields:
        return
    f = draw(st.sampled_from(fields))
    if f.message_type is not None:  # a Tensor: unset it, or change it
        if draw(st.integers(0, 4)) == 0:
            msg.ClearField(f.name)
        else:
            draw(mutate_tensor(getattr(msg, f.name), run))
    elif f.type == FieldDescriptor.TYPE_STRING:
        setattr(msg, f.name, draw(st.sampled_from(["", "other-run", run.run_id.upper(), "x" * 129]) | TEXT))
    elif f.type == FieldDescriptor.TYPE_UINT32:
        setattr(msg, f.name, draw(st.sampled_from([0, 1, 2, 7, 2**31, 2**32 - 1]) | st.integers(0, 2**32 - 1)))
    elif f.type == FieldDescriptor.TYPE_UINT64:
        setattr(msg, f.name, draw(st.sampled_from([0, 1, 2, 3, 2**63, 2**64 - 1]) | st.integers(0, 2**64 - 1)))
    elif f.type == FieldDescriptor.TYPE_FLOAT:
        setattr(msg, f.name, draw(st.floats(width=32)))
    elif f.type == FieldDescriptor.TYPE_BOOL:
        setattr(msg, f.name, not getattr(msg, f.name))


@st.composite
def mutate_bytes(draw, data: bytes) -> bytes:
    what = draw(st.sampled_from(["cut", "flip", "insert"]))
    if not data:
        return draw(st.binary(max_size=64))
    at = draw(st.integers(0, len(data) - 1))
    if what == "cut":
        return data[:at]
    if what == "flip":
        return data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1 :]
    return data[:at] + draw(st.binary(min_size=1, max_size=16)) + data[at:]


@st.composite
def stage_calls(draw, run: RunConfig) -> Call:
    worker = draw(st.sampled_from(["first", "last"]))
    method = draw(st.sampled_from(list(REQUESTS)))
    alongside = draw(st.integers(0, 3)) == 0
    if draw(st.integers(0, 9)) == 0:
        return Call(worker, method, draw(st.binary(max_size=512)), alongside)
    msg = draw(valid_request(run, worker, method))
    for _ in range(draw(st.integers(0, 3))):
        draw(mutate(msg, run))
    data = msg.SerializeToString()
    if draw(st.integers(0, 5)) == 0:
        data = draw(mutate_bytes(data))
    if draw(st.integers(0, 9)) == 0:
        method = draw(st.sampled_from(list(REQUESTS)))  # well-formed, for another method
    return Call(worker, method, data, alongside)


# -- sending them ----------------------------------------------------------------------------


def response_tensors(response: Message) -> list[pb.Tensor]:
    found = []
    for _, value in response.ListFields():
        if not isinstance(value, Message) and isinstance(value, int | float | str | bytes):
            continue
        for item in [value] if isinstance(value, Message) else value:
            if isinstance(item, pb.NamedTensor):
                item = item.tensor
            if isinstance(item, pb.Tensor):
                found.append(item)
    return found


def good_input(run: RunConfig, stage: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    if stage == 0:
        return torch.randint(0, run.model.vocab_size, (2, 8), generator=gen)
    return torch.randn(2, 8, run.model.d_model, generator=gen)


class StageFuzz:
    """Sends calls to workers and judges the answers; counts every status code it saw."""

    def __init__(self, run: RunConfig, workers: dict[str, tuple[str, Callable[[], bool]]], timeout: float = 60):
        """`workers`: {'first' | 'last': (address, is_alive)}."""
        self.run, self.timeout = run, timeout
        self.alive = {name: alive for name, (_, alive) in workers.items()}
        # The client's limit is far above the server's, so oversized requests reach the server.
        options = grpc_options(run.model_copy(update={"wire": run.wire.model_copy(update={"max_message_mb": 256})}))
        self.channels = {
            name: grpc.insecure_channel(address, options=options) for name, (address, _) in workers.items()
        }
        self.codes: collections.Counter[str] = collections.Counter()
        self.cases = 0
        last = run.stages.count - 1
        targets = encode(good_input(run, 0))
        self.good = {
            "first": pb.ForwardRequest(run_id=run.run_id, stage=0, input=encode(good_input(run, 0))),
            "last": pb.ForwardRequest(
                run_id=run.run_id, stage=last, input=encode(good_input(run, last)), targets=targets
            ),
        }

    def _rpc(self, worker: str, method: str):
        return self.channels[worker].unary_unary(
            method_path(method), request_serializer=None, response_deserializer=None
        )

    def failure(self, call: Call) -> str | None:
        """None when the answer is OK or a clean refusal (and a good Forward sent alongside was
        served); else what was wrong."""
        self.cases += 1
        sent = self._rpc(call.worker, call.method).future(call.payload, timeout=self.timeout)
        good = None
        if call.alongside:
            good = self._rpc(call.worker, "Forward").future(self.good[call.worker].SerializeToString(), self.timeout)
        problem = self._judge(call, sent)
        return problem if problem is not None or good is None else self._judge_good(call.worker, good)

    def _judge_good(self, worker: str, sent: grpc.Future) -> str | None:
        try:
            response = pb.ForwardResponse.FromString(sent.result())
        except grpc.RpcError as err:
            return f"a good Forward sent alongside got {err.code().name}: {err.details()}"
        if worker == "first":
            out = decode(response.output)
            if out.shape != (*good_input(self.run, 0).shape, self.run.model.d_model) or not torch.isfinite(out).all():
                return f"a good Forward sent alongside got an output of shape {list(out.shape)}, or not finite"
        elif not (math.isfinite(response.loss) and response.loss > 0):
            return f"a good Forward sent alongside got a loss of {response.loss}"
        return None

    def _judge(self, call: Call, sent: grpc.Future) -> str | None:
        try:
            data = sent.result()
        except grpc.RpcError as err:
            self.codes[err.code().name] += 1
            if not self.alive[call.worker]():
                return f"the {call.worker} worker exited ({err.code().name}: {err.details()})"
            if err.code() not in CLEAN:
                return f"{err.code().name}: {err.details()}"
            if not err.details():
                return f"{err.code().name} without a message"
            return None
        self.codes["OK"] += 1
        try:
            for tensor in response_tensors(RESPONSES[call.method].FromString(data)):
                check(tensor, "response")
        except (DecodeError, WireError) as err:
            return f"OK, but the answer is malformed: {err}"
        return None

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()


def run_stage_fuzz(
    fuzz: StageFuzz, cases: int, stop_at_failure: bool, note: Callable[[str], None] | None = None
) -> list[str]:
    """Draw `cases` calls; returns the failures (with `stop_at_failure`, hypothesis shrinks the first
    one to a smallest failing call and raises it). `note` hears of the progress every 1000 calls."""
    failures: list[str] = []

    @settings(
        max_examples=cases,
        deadline=None,
        database=None,
        derandomize=False,
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
    )
    @given(call=stage_calls(fuzz.run))
    def one(call: Call) -> None:
        problem = fuzz.failure(call)
        if note is not None and fuzz.cases % 1000 == 0:
            note(f"stage service: {fuzz.cases} calls, {len(failures) + (problem is not None)} failures")
        if problem is not None:
            failures.append(f"{call!r}: {problem}")
            assert not stop_at_failure, problem

    one()
    return failures


def right_answer_gap(run: RunConfig, address: str, stage: int) -> float:
    """Largest difference between the worker's answer to a good Forward and a local Stage holding the
    weights the worker serves (raises if those weights are not finite)."""
    client = StageClient(address, run, timeout=30)
    try:
        before = client.parameters(stage)
        weights = {p.name: decode(p.tensor) for p in before.parameters}
        bad = [name for name, w in weights.items() if not torch.isfinite(w).all()]
        assert not bad, f"stage {stage} holds non-finite weights: {bad[:3]}"
        x = good_input(run, stage)
        served = decode(client.forward(stage, encode(x), "after-fuzz", step=0, train=False).output)
        after = client.parameters(stage)
        assert after.optimizer_steps == before.optimizer_steps, "the weights changed during the check"
    finally:
        client.close()
    local = Stage(run, stage)
    with torch.no_grad():
        for name, p in local.named_parameters():
            p.copy_(weights[name])
        expected = local(x)
    assert served.shape == expected.shape, (served.shape, expected.shape)
    return float((served - expected).abs().max())


# -- the REST API ----------------------------------------------------------------------------


def run_rest_fuzz(
    base_url: str, cases: int, alive: Callable[[], bool], note: Callable[[str], None] | None = None
) -> tuple[int, list[str], collections.Counter]:
    """Send at least `cases` schemathesis-drawn requests to the API at `base_url`; returns the count,
    the failures (5xx, dropped connections) and the status codes seen."""
    import requests
    import schemathesis
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    session = requests.Session()
    statuses: collections.Counter[int | str] = collections.Counter()
    failures: list[str] = []
    sent = 0

    def send(case) -> None:
        nonlocal sent
        sent += 1
        if note is not None and sent % 1000 == 0:
            note(f"REST API: {sent} requests, {len(failures)} failures")
        try:
            response = case.call(base_url=base_url, session=session, timeout=30)
        except requests.RequestException as err:
            statuses["error"] += 1
            failures.append(f"{case.method} {case.formatted_path}: {type(err).__name__}: {err}")
            return
        statuses[response.status_code] += 1
        if response.status_code >= 500:
            failures.append(f"{case.method} {case.formatted_path} {case.query}: {response.status_code}")

    # An operation without parameters has few possible requests, and none that the schema forbids
    # (hypothesis then finds nothing to send): it is left out of later rounds. The rounds go on, over
    # the others, until the count is reached.
    pairs = [(op, mode) for op in operations for mode in GenerationMode]
    for _ in range(50):
        if sent >= cases or not pairs or failures and not alive():
            break
        share = max(1, math.ceil((cases - sent) / len(pairs)))
        for op, mode in list(pairs):
            before = sent
            with contextlib.suppress(Unsatisfiable):
                settings(max_examples=share, deadline=None, database=None, suppress_health_check=list(HealthCheck))(
                    given(case=op.as_strategy(generation_mode=mode))(send)
                )()
            if sent - before < share:
                pairs.remove((op, mode))
    session.close()
    return sent, failures, statuses


def rest_still_serves(base_url: str) -> None:
    import httpx

    for path in ("/api/v1/state", "/api/v1/join", "/metrics"):
        response = httpx.get(f"{base_url}{path}", timeout=10)
        assert response.status_code == 200, f"{path}: {response.status_code}"
    assert "stages" in httpx.get(f"{base_url}/api/v1/state", timeout=10).json()


# -- the benchmark ---------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="configs/tiny.toml", help="run config of the workers and the coordinator")
    p.add_argument("--cases", type=int, default=10_000, help="requests to the stage service, and as many to the API")
    p.add_argument("--log-dir", default=None)


def run(args: argparse.Namespace) -> str:
    from benchmarks.common import Proc, log_dir, start_coordinator, stop_all
    from benchmarks.results import append_row
    from swarm.ready import PeerReady, wait_ready

    tmp = log_dir(args.log_dir, "fuzz")
    fuzz_cfg = fuzz_run(load_config(args.config))
    path = write_config(fuzz_cfg, tmp)
    last = fuzz_cfg.stages.count - 1
    procs = {
        name: Proc(
            ["peer", "--config", str(path), "--stage", str(k), "--port", "0", "--threads", "1"],
            tmp / f"{name}.log",
            ready=True,
        )
        for name, k in (("first", 0), ("last", last))
    }
    coordinator = None
    try:
        addresses = {name: wait_ready(p, PeerReady, 120).address for name, p in procs.items()}
        workers = {name: (addresses[name], lambda p=p: p.popen.poll() is None) for name, p in procs.items()}
        fuzz = StageFuzz(fuzz_cfg, workers)
        start = time.perf_counter()
        failures = run_stage_fuzz(fuzz, args.cases, stop_at_failure=False, note=lambda text: print(text, flush=True))
        stage_s = time.perf_counter() - start
        fuzz.close()
        gaps = {name: right_answer_gap(fuzz_cfg, addresses[name], k) for name, k in (("first", 0), ("last", last))}
        alive = all(p.popen.poll() is None for p in procs.values())
        for failure in failures[:20]:
            print(f"stage service: {failure}", flush=True)
        codes = ", ".join(f"{code} {n}" for code, n in fuzz.codes.most_common())
        print(f"stage service: {fuzz.cases} calls in {stage_s:.0f} s, {len(failures)} failures; {codes}", flush=True)
        print(f"stage service: good Forward after the fuzz differs from a local Stage by {gaps}", flush=True)

        coordinator, url = start_coordinator(Path(args.config), tmp / "coordinator.log")
        start = time.perf_counter()
        sent, rest_failures, statuses = run_rest_fuzz(
            url, args.cases, lambda: coordinator.popen.poll() is None, note=lambda text: print(text, flush=True)
        )
        rest_s = time.perf_counter() - start
        rest_still_serves(url)
        rest_alive = coordinator.popen.poll() is None
        for failure in rest_failures[:20]:
            print(f"REST API: {failure}", flush=True)
        seen = ", ".join(f"{code} {n}" for code, n in sorted(statuses.items(), key=lambda kv: str(kv[0])))
        print(f"REST API: {sent} requests in {rest_s:.0f} s, {len(rest_failures)} failures; {seen}", flush=True)
    finally:
        stop_all([*procs.values(), *([coordinator] if coordinator else [])])
    right = max(gaps.values()) <= 1e-4
    return append_row(
        SECTION,
        [
            "config",
            "stage calls",
            "non-clean answers",
            "workers alive",
            "good Forward right after",
            "stage s",
            "REST requests",
            "REST 5xx or dropped",
            "coordinator alive and serving",
            "REST s",
            "notes",
        ],
        [
            args.config,
            fuzz.cases,
            len(failures),
            "yes" if alive else "NO",
            f"yes (max diff {max(gaps.values()):.1e})" if right else f"NO (max diff {max(gaps.values()):.1e})",
            f"{stage_s:.0f}",
            sent,
            len(rest_failures),
            "yes" if rest_alive else "NO",
            f"{rest_s:.0f}",
            f"stage answers: {codes}; REST statuses: {seen}",
        ],
    )
