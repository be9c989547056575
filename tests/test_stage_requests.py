"""Malformed requests to real stage workers (separate processes, gRPC on loopback).

Every bad request is refused with its own gRPC status code and a message that names what was
wrong, never INTERNAL or UNKNOWN; and after each one the same worker still serves a good request.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from google.protobuf.message import Message

from swarm.client import StageClient
from swarm.config import load_config
from swarm.rpc import method_path, pb
from swarm.wire import decode, encode
from tests.conftest import CONFIGS
from tests.harness import swarm_fixture
from tests.processes import start_peer

CONFIG = CONFIGS / "tiny.toml"
RUN = load_config(CONFIG)
D, V, SEQ, MAX_BATCH = RUN.model.d_model, RUN.model.vocab_size, RUN.model.seq_len, RUN.serve.max_batch
LAST = RUN.stages.count - 1

INVALID = grpc.StatusCode.INVALID_ARGUMENT
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
SERVER_FAULTS = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)


# -- workers ---------------------------------------------------------------------------------


def small_limit_config(tmp: Path) -> Path:
    """tiny.toml with a 1 MB gRPC message limit."""
    text = CONFIG.read_text()
    assert text.count('codec = "none"\n') == 1
    path = tmp / "tiny-1mb.toml"
    path.write_text(text.replace('codec = "none"\n', 'codec = "none"\nmax_message_mb = 1\n'))
    assert load_config(path).wire.max_message_mb == 1
    return path


@swarm_fixture(scope="module")
def workers(tmp_path_factory):
    """Stage 0 and stage 1 of tiny.toml, and stage 1 of a copy with a 1 MB message limit.

    Started side by side (each spends seconds importing torch); yields {name: (proc, client)}.
    """
    tmp = tmp_path_factory.mktemp("stage-requests")
    specs = {"s0": (CONFIG, 0), "s1": (CONFIG, 1), "small": (small_limit_config(tmp), 1)}
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = {name: pool.submit(start_peer, path, stage, tmp) for name, (path, stage) in specs.items()}
    started, errors = {}, []
    for name, future in futures.items():
        try:
            started[name] = future.result()
        except Exception as err:  # stop the ones that did start before failing
            errors.append(err)
    if errors:
        for proc, _ in started.values():
            proc.stop()
        raise errors[0]
    # Every client has tiny.toml's 256 MB limit, so oversized requests reach the server.
    handles = {name: (proc, StageClient(address, RUN, timeout=30)) for name, (proc, address) in started.items()}
    yield handles
    alive = {name: proc.popen.poll() is None for name, (proc, _) in handles.items()}
    for proc, client in handles.values():
        client.close()
        proc.stop()
    assert all(alive.values()), f"a worker died during the module: {alive}"


# -- building requests -----------------------------------------------------------------------


def ids(b: int, t: int) -> torch.Tensor:
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(1000 * b + t))


def hidden(b: int, t: int, width: int = D) -> torch.Tensor:
    return torch.randn(b, t, width, generator=torch.Generator().manual_seed(1000 * b + t + width))


def poked(x: torch.Tensor, value: float) -> torch.Tensor:
    """`x` with one element set to `value`."""
    x = x.clone()
    x.view(-1)[x.numel() // 2] = value
    return x


def tensor(x: torch.Tensor, codec: str = "none", *, shape=None, cut: int = 0, pad: int = 0, **fields) -> pb.Tensor:
    """Encode `x`, then corrupt the message: override the header, cut or pad the payload."""
    msg = encode(x, codec)
    if shape is not None:
        del msg.shape[:]
        msg.shape.extend(shape)
    for name, value in fields.items():  # dtype=..., codec_name=... (the header's codec, not the one used)
        setattr(msg, name.removesuffix("_name"), value)
    if cut:
        msg.data = msg.data[:-cut]
    msg.data += b"\0" * pad
    return msg


def nan_int8_scale(x: torch.Tensor) -> pb.Tensor:
    """An int8-coded tensor whose first block scale is NaN: the payload is well-formed, the values not."""
    msg = encode(x, "int8")
    msg.data = struct.pack("<f", math.nan) + msg.data[4:]
    return msg


def fwd(inputs: pb.Tensor | None, stage: int = 0, targets: pb.Tensor | None = None, train: bool = False, **kw):
    kw = {"run_id": RUN.run_id, "microbatch_id": "mb", **kw}
    req = pb.ForwardRequest(stage=stage, train=train, **kw)
    if inputs is not None:
        req.input.CopyFrom(inputs)
    if targets is not None:
        req.targets.CopyFrom(targets)
    return req


def bwd(inputs: pb.Tensor | None, grad: pb.Tensor | None, stage: int = 0, **kw):
    kw = {"run_id": RUN.run_id, "microbatch_id": "mb", **kw}
    req = pb.BackwardRequest(stage=stage, **kw)
    if inputs is not None:
        req.input.CopyFrom(inputs)
    if grad is not None:
        req.output_grad.CopyFrom(grad)
    return req


def send(client: StageClient, method: str, request: Message | bytes, timeout: float = 30):
    if isinstance(request, bytes):  # raw bytes, not necessarily a valid protobuf
        raw = client.channel.unary_unary(method_path(method), request_serializer=None, response_deserializer=None)
        return raw(request, timeout=timeout)
    return client.call(method, request, timeout)


def expect_refused(client: StageClient, method: str, request, code: grpc.StatusCode, match: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        send(client, method, request)
    err = info.value
    assert err.code() not in SERVER_FAULTS, f"server fault: {err.code()} {err.details()}"
    assert err.code() == code, f"{err.code()}: {err.details()}"
    assert match in err.details(), f"{match!r} not in {err.details()!r}"
    return err


def expect_serves(client: StageClient, stage: int) -> None:
    """A small good forward succeeds: hidden states from stage 0, a finite loss from the last."""
    if stage == 0:
        out = decode(client.forward(0, encode(ids(2, 8)), "good", step=0, train=False).output)
        assert out.shape == (2, 8, D) and torch.isfinite(out).all()
    else:
        resp = client.forward(stage, encode(hidden(2, 8)), "good", step=0, targets=encode(ids(2, 8)), train=False)
        assert math.isfinite(resp.loss) and resp.loss > 0


# -- the cases -------------------------------------------------------------------------------


@dataclass
class Case:
    name: str
    target: str  # worker and method: "s0 Forward", "s1 Backward", ...
    build: Callable[[], Message | bytes]
    match: str  # a substring of the error's details
    code: grpc.StatusCode = INVALID


H, H_V, X = (lambda: tensor(hidden(2, 8))), (lambda: tensor(hidden(2, 8, V))), (lambda: tensor(ids(2, 8)))

# fmt: off
CASES = [
    # wrong shape
    Case("hidden width 64", "s1 Forward", lambda: fwd(tensor(hidden(2, 8, 64)), 1),
         f"input: shape [2, 8, 64] where [batch, seq_len, {D}] is expected"),
    Case("hidden 4-D", "s1 Forward", lambda: fwd(tensor(hidden(2, 8).view(2, 2, 4, D)), 1), f"shape [2, 2, 4, {D}]"),
    Case("ids 4-D", "s0 Forward", lambda: fwd(tensor(ids(2, 8).view(2, 2, 2, 2))),
         "input: shape [2, 2, 2, 2] where [batch, seq_len] is expected"),
    Case("ids 1-D", "s0 Forward", lambda: fwd(tensor(ids(1, 8).view(8))), "where [batch, seq_len] is expected"),
    Case("targets shorter than input", "s1 Forward", lambda: fwd(H(), 1, targets=tensor(ids(2, 7))),
         "targets: shape [2, 7] does not match the input's [2, 8]"),
    Case("targets batch differs", "s1 Forward", lambda: fwd(H(), 1, targets=tensor(ids(3, 8))),
         "does not match the input's"),
    Case("targets 3-D", "s1 Forward", lambda: fwd(H(), 1, targets=tensor(ids(2, 8).view(2, 8, 1))),
         "targets: shape [2, 8, 1]"),
    Case("batch 0 ids", "s0 Forward", lambda: fwd(tensor(ids(0, 8))), "batch size 0 outside"),
    Case("batch 0 hidden", "s1 Forward", lambda: fwd(tensor(hidden(0, 8)), 1), "batch size 0 outside"),
    Case("sequence 0", "s0 Forward", lambda: fwd(tensor(ids(2, 0))), "sequence length 0 outside"),
    Case("sequence 129 ids", "s0 Forward", lambda: fwd(tensor(ids(1, SEQ + 1))),
         f"sequence length {SEQ + 1} outside 1..{SEQ} (model.seq_len)"),
    Case("sequence 129 hidden", "s1 Forward", lambda: fwd(tensor(hidden(1, SEQ + 1)), 1),
         f"sequence length {SEQ + 1} outside"),
    Case("negative dimension", "s1 Forward", lambda: fwd(tensor(hidden(2, 8), shape=[2, -8, D]), 1),
         "sequence length -8 outside"),
    Case("output_grad shape differs from input", "s0 Backward", lambda: bwd(X(), tensor(hidden(2, 4))),
         "output_grad: shape [2, 4, 128] does not match the input's"),
    Case("output_grad width", "s1 Backward", lambda: bwd(H(), H(), 1),
         f"output_grad: shape [2, 8, {D}] where [batch, seq_len, {V}] is expected"),
    # wrong dtype
    Case("float ids", "s0 Forward", lambda: fwd(tensor(ids(2, 8).float())), "dtype float32 where token ids"),
    Case("int64 hidden", "s1 Forward", lambda: fwd(tensor(ids(2, 8 * D).view(2, 8, D)), 1),
         "dtype int64 where a floating tensor is expected"),
    Case("unknown dtype ids", "s0 Forward", lambda: fwd(tensor(ids(2, 8), dtype="uint4")), "dtype uint4"),
    Case("unknown dtype hidden", "s1 Forward", lambda: fwd(tensor(hidden(2, 8), dtype="float8"), 1), "dtype float8"),
    Case("empty dtype", "s1 Forward", lambda: fwd(tensor(hidden(2, 8), dtype=""), 1), "dtype (empty)"),
    Case("float targets", "s1 Forward", lambda: fwd(H(), 1, targets=tensor(ids(2, 8).float())),
         "targets: dtype float32"),
    Case("int64 output_grad", "s0 Backward", lambda: bwd(X(), tensor(ids(2, 8 * D).view(2, 8, D))),
         "output_grad: dtype int64"),
    # NaN and Inf
    Case("NaN hidden", "s1 Forward", lambda: fwd(tensor(poked(hidden(2, 8), math.nan)), 1),
         "input: contains NaN or Inf"),
    Case("Inf hidden", "s1 Forward", lambda: fwd(tensor(poked(hidden(2, 8), -math.inf)), 1),
         "input: contains NaN or Inf"),
    Case("NaN hidden bf16 codec", "s1 Forward", lambda: fwd(tensor(poked(hidden(2, 8), math.nan), "bf16"), 1),
         "input: contains NaN or Inf"),
    Case("NaN int8 scale", "s1 Forward", lambda: fwd(nan_int8_scale(hidden(2, 8)), 1), "input: contains NaN or Inf"),
    Case("NaN output_grad stage 0", "s0 Backward", lambda: bwd(X(), tensor(poked(hidden(2, 8), math.nan))),
         "output_grad: contains NaN or Inf"),
    Case("Inf output_grad stage 1", "s1 Backward", lambda: bwd(H(), tensor(poked(hidden(2, 8, V), math.inf)), 1),
         "output_grad: contains NaN or Inf"),
    Case("NaN backward input", "s1 Backward", lambda: bwd(tensor(poked(hidden(2, 8), math.nan)), H_V(), 1),
         "input: contains NaN or Inf"),
    # token ids out of range
    Case("token id 256", "s0 Forward", lambda: fwd(tensor(poked(ids(2, 8), V))), f"token ids must lie in 0..{V - 1}"),
    Case("token id -1", "s0 Forward", lambda: fwd(tensor(poked(ids(2, 8), -1))), f"token ids must lie in 0..{V - 1}"),
    Case("int32 token id 256", "s0 Forward", lambda: fwd(tensor(poked(ids(2, 8), V).int())), "token ids must lie"),
    Case("target id 256", "s1 Forward", lambda: fwd(H(), 1, targets=tensor(poked(ids(2, 8), V))),
         "targets: token ids must lie"),
    Case("target id -1", "s1 Forward", lambda: fwd(H(), 1, targets=tensor(poked(ids(2, 8), -1))),
         "targets: token ids must lie"),
    # batch over serve.max_batch (for wire.max_message_mb see test_message_over_grpc_limit)
    Case("batch 65 ids", "s0 Forward", lambda: fwd(tensor(ids(MAX_BATCH + 1, 2))),
         f"batch size {MAX_BATCH + 1} outside 1..{MAX_BATCH} (serve.max_batch)"),
    Case("batch 65 hidden", "s1 Forward", lambda: fwd(tensor(hidden(MAX_BATCH + 1, 1)), 1), "serve.max_batch"),
    Case("batch 65 backward", "s0 Backward",
         lambda: bwd(tensor(ids(MAX_BATCH + 1, 1)), tensor(hidden(MAX_BATCH + 1, 1))), "serve.max_batch"),
    # wrong stage or run
    Case("unknown stage", "s0 Forward", lambda: fwd(X(), 7), "unknown stage 7"),
    Case("unknown stage backward", "s1 Backward", lambda: bwd(H(), H_V(), 7), "unknown stage 7"),
    Case("stage 1 request to stage 0", "s0 Forward", lambda: fwd(H(), 1),
         "this worker serves stage 0, not stage 1", PRECONDITION),
    Case("stage 0 request to stage 1", "s1 Backward", lambda: bwd(X(), H()),
         "this worker serves stage 1, not stage 0", PRECONDITION),
    Case("other run id", "s0 Forward", lambda: fwd(X(), run_id="other-run"),
         "run_id: request is for run 'other-run'", PRECONDITION),
    Case("other run id backward", "s1 Backward", lambda: bwd(H(), H_V(), 1, run_id="other-run"), "run_id",
         PRECONDITION),
    Case("other run id parameters", "s0 Parameters", lambda: pb.ParametersRequest(run_id="other-run"), "run_id",
         PRECONDITION),
    Case("other stage parameters", "s1 Parameters", lambda: pb.ParametersRequest(run_id=RUN.run_id, stage=0),
         "not stage 0", PRECONDITION),
    # payload does not match its header
    Case("ids truncated", "s0 Forward", lambda: fwd(tensor(ids(2, 8), cut=1)),
         "input: payload has 127 bytes, expected 128"),
    Case("ids header larger than payload", "s0 Forward", lambda: fwd(tensor(ids(2, 8), shape=[2, 16])),
         "payload has 128 bytes, expected 256"),
    Case("hidden truncated", "s1 Forward", lambda: fwd(tensor(hidden(2, 8), cut=4), 1), "payload has"),
    Case("hidden padded", "s1 Forward", lambda: fwd(tensor(hidden(2, 8), pad=4), 1), "payload has"),
    Case("int8 truncated", "s1 Forward", lambda: fwd(tensor(hidden(2, 8), "int8", cut=1), 1), "payload has"),
    Case("int8 scales only", "s1 Forward", lambda: fwd(tensor(hidden(2, 8), "int8", cut=2 * 8 * D), 1),
         "payload has 32 bytes"),
    Case("fp16 output_grad truncated", "s0 Backward", lambda: bwd(X(), tensor(hidden(2, 8), "fp16", cut=2)),
         "output_grad: payload has"),
    Case("targets truncated", "s1 Forward", lambda: fwd(H(), 1, targets=tensor(ids(2, 8), cut=8)),
         "targets: payload has"),
    # not a protobuf, or an empty one
    Case("garbage bytes", "s0 Forward", lambda: b"\xff\xff\xff\xff", "not a valid swarm.ForwardRequest"),
    Case("garbage bytes backward", "s1 Backward", lambda: b"\xff\xff\xff\xff", "not a valid swarm.BackwardRequest"),
    Case("cut protobuf", "s0 Forward", lambda: fwd(X()).SerializeToString()[:-10], "not a valid swarm.ForwardRequest"),
    Case("empty request", "s0 Forward", lambda: b"", "run_id: missing"),
    Case("empty request backward", "s1 Backward", lambda: b"", "run_id: missing"),
    Case("no input", "s0 Forward", lambda: fwd(None), "input: missing"),
    Case("no input backward", "s1 Backward", lambda: bwd(None, H_V(), 1), "input: missing"),
    # codecs
    Case("unknown codec", "s1 Forward", lambda: fwd(tensor(hidden(2, 8), codec_name="zstd"), 1),
         "unknown codec 'zstd'"),
    Case("unknown codec ids", "s0 Forward", lambda: fwd(tensor(ids(2, 8), codec_name="gzip")), "unknown codec 'gzip'"),
    Case("lossy codec on ids", "s0 Forward", lambda: fwd(tensor(ids(2, 8), codec_name="int8")),
         "codec int8 applies to floating tensors, not int64"),
    # targets and training
    Case("targets to stage 0", "s0 Forward", lambda: fwd(X(), targets=X()), "targets: only the last stage"),
    Case("train without targets", "s1 Forward", lambda: fwd(H(), 1, train=True),
         "targets: required for a training forward"),
    Case("loss_scale above 1", "s1 Forward", lambda: fwd(H(), 1, targets=X(), train=True, loss_scale=2.0),
         "loss_scale: 2.0 outside (0, 1]"),
    Case("loss_scale NaN", "s1 Forward", lambda: fwd(H(), 1, targets=X(), train=True, loss_scale=math.nan),
         "loss_scale: nan"),
    Case("microbatch_id too long", "s0 Forward", lambda: fwd(X(), microbatch_id="x" * 129),
         "microbatch_id: longer than 128"),
    # A step no run reaches: the stage would skip to it (a fuzzed 2**64 - 1 once broke its compute thread).
    Case("step too large, forward", "s0 Forward", lambda: fwd(X(), train=True, step=2**64 - 1),
         "step: 18446744073709551615 is beyond"),
    Case("step too large, backward", "s1 Backward", lambda: bwd(H(), H(), 1, step=2**31),
         "step: 2147483648 is beyond"),
    # spot checks' answers and taking a gradient back
    Case("check of a training forward", "s1 Forward", lambda: fwd(H(), 1, targets=X(), train=True, check=True),
         "check: only for a last-stage forward with targets and train=false"),
    Case("check without targets", "s1 Forward", lambda: fwd(H(), 1, check=True), "check: only for a last-stage"),
    # delayed updates: only a training forward whose backward comes later
    Case("delayed evaluation", "s0 Forward", lambda: fwd(X(), delayed=True),
         "delayed: only for a training forward of a stage before the last (1)"),
    Case("delayed last stage", "s1 Forward", lambda: fwd(H(), 1, targets=X(), train=True, delayed=True),
         "delayed: only for a training forward of a stage before the last"),
    Case("retract never served", "s1 Retract",
         lambda: pb.RetractRequest(run_id=RUN.run_id, stage=1, microbatch_id="never"),
         "microbatch_id: no gradient of 'never' is kept here", grpc.StatusCode.NOT_FOUND),
    Case("retract of another run", "s1 Retract", lambda: pb.RetractRequest(run_id="other", stage=1, microbatch_id="m"),
         "run_id: request is for run 'other'", PRECONDITION),
    Case("retract empty", "s0 Retract", lambda: b"", "run_id: missing"),
    Case("retract id too long", "s0 Retract",
         lambda: pb.RetractRequest(run_id=RUN.run_id, stage=0, microbatch_id="x" * 129), "longer than 128"),
    # finite, but the gradient it makes overflows: not kept, and no server fault (the fuzzer found it)
    Case("output_grad of 1e37", "s0 Backward", lambda: bwd(X(), tensor(torch.full((2, 8, D), 1e37))),
         "the gradient came out NaN or Inf", grpc.StatusCode.ABORTED),
    # backward without a gradient
    Case("missing output_grad stage 0", "s0 Backward", lambda: bwd(X(), None), "output_grad: missing"),
    Case("missing output_grad stage 1", "s1 Backward", lambda: bwd(H(), None, 1), "output_grad: missing"),
]
# fmt: on


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_request_refused_then_good_request_served(workers, case: Case):
    worker, method = case.target.split()
    _, client = workers[worker]
    expect_refused(client, method, case.build(), case.code, case.match)
    expect_serves(client, 0 if worker == "s0" else LAST)


def test_message_over_grpc_limit(workers):
    """wire.max_message_mb = 1: a ~2 MB request, or a 1.3 MB response, gets RESOURCE_EXHAUSTED; it still serves."""
    _, client = workers["small"]
    big = fwd(tensor(hidden(32, SEQ)), LAST, targets=tensor(ids(32, SEQ)))
    assert 2 * 2**20 < big.ByteSize() < 3 * 2**20
    expect_refused(client, "Forward", big, grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max")
    expect_refused(client, "Forward", b"\xff" * (2 * 2**20), grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max")
    expect_serves(client, LAST)
    # A request that fits but whose answer (logits, twice the input's size) does not.
    fits = fwd(tensor(hidden(10, SEQ)), LAST)
    assert fits.ByteSize() < 2**20 < 10 * SEQ * V * 4
    expect_refused(client, "Forward", fits, grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max")
    expect_serves(client, LAST)
    # A large request under the limit is served.
    resp = client.forward(LAST, encode(hidden(12, SEQ)), "fits", step=0, targets=encode(ids(12, SEQ)), train=False)
    assert math.isfinite(resp.loss)


def test_a_training_forwards_gradient_is_taken_back_by_its_caller_over_grpc(workers):
    _, client = workers["s1"]
    served = client.info().samples_served
    client.forward(LAST, tensor(hidden(2, 8)), "taken-back", step=0, targets=tensor(ids(2, 8)), train=True)
    assert client.info().samples_served == served + 2
    assert client.retract(LAST, "taken-back").samples == 2
    assert client.info().samples_served == served
    expect_refused(
        client,
        "Retract",
        pb.RetractRequest(run_id=RUN.run_id, stage=LAST, microbatch_id="taken-back"),
        grpc.StatusCode.NOT_FOUND,
        "no gradient of 'taken-back'",
    )


def test_workers_alive_after_the_suite(workers):
    for name, (proc, client) in workers.items():
        assert proc.popen.poll() is None, f"{name} exited:\n{proc.output()[-3000:]}"
        info = client.info()
        assert (info.run_id, info.stage) == (RUN.run_id, 0 if name == "s0" else LAST)
        assert info.bytes_received > 0
        expect_serves(client, info.stage)
