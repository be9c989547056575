"""Training through real stage workers (separate processes, gRPC on loopback)."""

import json
import threading
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from swarm.config import parse_config
from swarm.data import TrainStream
from swarm.model import Stage, lm_loss
from swarm.progress import RunLog
from swarm.trainer import StaticCaller, microbatch
from swarm.trainer.loop import run_training
from swarm.wire import decode, encode
from tests.conftest import CONFIGS, run_cli
from tests.processes import start_coordinator, start_peer


def write_config(tmp_path, name: str, stages: int, layers=None, codec="none", **training) -> tuple:
    data = tomllib.loads((CONFIGS / "tiny.toml").read_text())
    data["stages"] = {"count": stages, **({"layers": layers} if layers else {})}
    data["wire"]["codec"] = codec
    data["training"].update(training)
    run = parse_config(data)
    path = tmp_path / f"{name}.toml"
    path.write_text(toml_dump(data))
    return run, path


def toml_dump(data: dict) -> str:
    """Enough TOML for a run config: scalars, lists and one level of tables."""

    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return repr(v)

    lines = [f"{k} = {value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for section, table in data.items():
        if isinstance(table, dict):
            lines.append(f"\n[{section}]")
            lines += [f"{k} = {value(v)}" for k, v in table.items() if v is not None]
    return "\n".join(lines) + "\n"


def start_pipeline(path, stages, tmp_path):
    procs, addresses = [], []
    try:
        for k in range(stages):
            proc, address = start_peer(path, k, tmp_path)
            procs.append(proc)
            addresses.append(address)
    except Exception:
        for p in procs:
            p.stop()
        raise
    return procs, addresses


@pytest.mark.parametrize(
    "stages, layers, cache_size",
    [(2, None, 64), (3, [2, 1, 1], 64), (3, [1, 2, 1], 0)],
    ids=["2 stages", "3 stages", "3 stages, backward recomputes"],
)
def test_pipeline_matches_the_whole_model(processes, tmp_path, stages, layers, cache_size):
    run, path = write_config(tmp_path, "equal", stages, layers, global_batch=16, micro_batch=8)
    if cache_size == 0:
        path.write_text(path.read_text() + f"\n[serve]\ncache_size = {cache_size}\n")
    procs, addresses = start_pipeline(path, stages, tmp_path)
    try:
        pipe = StaticCaller(run, addresses)
        data = TrainStream.local(run.data, run.model.seq_len, run.training.seed)
        batch = data.next_microbatch(run.training.micro_batch)
        loss = microbatch(pipe, batch, step=0, name="check")  # half a global batch: no optimizer step yet

        whole = Stage(run.with_stages(1), 0)
        ref_loss = lm_loss(whole(batch.inputs), batch.targets)
        (ref_loss * batch.inputs.shape[0] / run.training.global_batch).backward()
        ref_grads = {n: p.grad for n, p in whole.named_parameters()}

        assert abs(loss - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
        seen = set()
        for k, client in enumerate(pipe.clients):
            state = client.parameters(k, with_grads=True)
            assert state.optimizer_steps == 0
            for item in state.grads:
                g, ref = decode(item.tensor), ref_grads[item.name]
                assert (g - ref).abs().max().item() <= 1e-5 * ref.abs().max().item(), item.name
                seen.add(item.name)
        assert seen == set(ref_grads)
        pipe.close()
    finally:
        for p in procs:
            p.stop()


def stage_grads(run, stage: int, weights: dict[str, torch.Tensor], inputs: torch.Tensor, grad: torch.Tensor) -> dict:
    """The weight gradients of `stage` at `weights` for this input and output gradient, computed here."""
    module = Stage(run, stage)
    module.load_state_dict(weights)
    module(inputs).backward(grad)
    return {n: p.grad for n, p in module.named_parameters()}


def grads_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest difference between two sets of gradients, relative to the largest gradient."""
    assert set(a) == set(b)
    return max((a[n] - b[n]).abs().max().item() / b[n].abs().max().item() for n in b)


@pytest.mark.parametrize("delayed", [True, False], ids=["delayed trainer", "synchronous trainer"])
def test_a_backward_after_the_stages_step_runs_on_the_weights_its_forward_ran_on_for_a_delayed_trainer(
    processes, tmp_path, delayed
):
    """Microbatch b's forward reaches stage 0, then microbatches a and c complete the global batch and
    the stages step, and only then does b's backward come. A trainer with delayed updates gets b's
    gradient on the weights b's forward ran on (the graph recorded then, kept through the step: a
    gradient one step stale), with no forward run again; for any other caller stage 0 runs b's
    forward again on its new weights, as a peer that never saw the forward would (spot checks compare
    answers on the weights of the moment)."""
    run, path = write_config(tmp_path, "stale", 2, global_batch=16, micro_batch=8, eval_every=0)
    procs, addresses = start_pipeline(path, 2, tmp_path)
    try:
        pipe = StaticCaller(run, addresses)
        first, last = pipe.clients
        data = TrainStream.local(run.data, run.model.seq_len, run.training.seed)
        a, b, c = (data.next_microbatch(run.training.micro_batch) for _ in range(3))
        before = {item.name: decode(item.tensor) for item in first.parameters(0).parameters}
        microbatch(pipe, a, step=0, name="a")
        hidden = first.forward(0, encode(b.inputs), "b", 0, delayed=delayed).output
        microbatch(pipe, c, step=0, name="c")  # the global batch is complete: both stages step
        deadline = time.monotonic() + 30
        while first.parameters(0).optimizer_steps < 1:
            assert time.monotonic() < deadline, "stage 0 did not step"
            time.sleep(0.05)
        after = {item.name: decode(item.tensor) for item in first.parameters(0).parameters}
        answer = last.forward(1, hidden, "b", 0, targets=encode(b.targets), train=True)
        first.backward(0, encode(b.inputs), answer.input_grad, "b", 0)
        state = first.parameters(0, with_grads=True)
        assert state.optimizer_steps == 1
        served = {item.name: decode(item.tensor) for item in state.grads}  # b's gradient alone: a and c were stepped
        grad = decode(answer.input_grad)
        on_before = stage_grads(run, 0, before, b.inputs, grad)
        on_after = stage_grads(run, 0, after, b.inputs, grad)
        assert grads_distance(on_after, on_before) > 1e-2  # the step moved the gradient well beyond noise
        expected, other = (on_before, on_after) if delayed else (on_after, on_before)
        assert grads_distance(served, expected) <= 1e-5, grads_distance(served, expected)
        assert grads_distance(served, other) > 1e-3
        pipe.close()
    finally:
        for p in procs:
            p.stop()
    (log,) = tmp_path.glob("peer-0-*.log")
    lines = log.read_text()
    assert f"{0 if delayed else 8} samples' forwards recomputed in backward, {8 if delayed else 0} backward" in lines


def run_pipeline(tmp_path, codec: str, steps: int) -> list[dict]:
    run, path = write_config(tmp_path, codec, 2, codec=codec, eval_every=0)
    procs, addresses = start_pipeline(path, 2, tmp_path)
    log = tmp_path / f"{codec}.jsonl"
    try:
        result = run_cli(
            "train",
            "--config",
            str(path),
            "--peers",
            ",".join(addresses),
            "--steps",
            str(steps),
            "--inflight",
            "2",
            "--log-json",
            str(log),
        )
        assert result.returncode == 0, result.stderr[-3000:]
    finally:
        for p in procs:
            p.stop()
    return [json.loads(line) for line in log.read_text().splitlines()]


def final_loss(records: list[dict]) -> float:
    return sum(r["loss"] for r in records[-5:]) / 5


def test_lossy_codecs_train_like_the_uncompressed_run(processes, tmp_path):
    # 25 steps take the reference from chance (ln 256 = 5.55) to about 3.0; the codecs' losses were within
    # 0.04% of it there (the bound is 3%); 50 steps took 15 s more.
    steps, codecs = 25, ("none", "fp16", "bf16", "int8")
    # Four independent pipelines, side by side: each spends much of its time waiting (interpreters
    # importing torch, one stage for the other), so together they take about as long as two in a row.
    with ThreadPoolExecutor(len(codecs)) as pool:
        runs = dict(zip(codecs, pool.map(lambda codec: run_pipeline(tmp_path, codec, steps), codecs), strict=True))
    reference = runs["none"]
    assert len(reference) == steps and final_loss(reference) < 3.5
    for codec in codecs[1:]:
        records = runs[codec]
        assert len(records) == steps
        ratio = final_loss(records) / final_loss(reference)
        assert abs(ratio - 1) <= 0.03, f"{codec}: loss {final_loss(records):.4f} vs {final_loss(reference):.4f}"
        # lossy codecs put fewer bytes on the wire than raw float32
        assert records[-1]["wire_bytes"] < reference[-1]["wire_bytes"]


def test_trainer_refuses_a_mismatched_pipeline(processes, tmp_path):
    run, path = write_config(tmp_path, "two", 2)
    procs, addresses = start_pipeline(path, 2, tmp_path)
    try:
        result = run_cli("train", "--config", str(path), "--peers", ",".join(reversed(addresses)), "--steps", "1")
        assert result.returncode == 2
        assert "serves stage 1, listed as stage 0" in result.stderr
        result = run_cli("train", "--config", str(path), "--peers", addresses[0], "--steps", "1")
        assert result.returncode == 2 and "1 addresses for a run of 2 stages" in result.stderr
        assert "Traceback" not in result.stderr
    finally:
        for p in procs:
            p.stop()


def test_worker_reports_itself(processes, tmp_path):
    run, path = write_config(tmp_path, "info", 2)
    procs, addresses = start_pipeline(path, 2, tmp_path)
    try:
        pipe = StaticCaller(run, addresses)
        data = TrainStream.local(run.data, run.model.seq_len, run.training.seed)
        for i in range(run.training.accumulation):
            microbatch(pipe, data.next_microbatch(run.training.micro_batch), 0, f"m{i}")
        # The step follows the global batch's last backward, which answers first: on a loaded machine
        # the first look came before it (optimizer_steps 0).
        deadline = time.monotonic() + 30
        while min(c.info().optimizer_steps for c in pipe.clients) == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        info = pipe.clients[1].info()
        assert (info.run_id, info.stage, info.num_stages, info.codec) == (run.run_id, 1, 2, "none")
        assert info.model_hash == run.model_hash()
        assert info.samples_served == run.training.global_batch and info.optimizer_steps == 1
        assert info.throughput > 0 and info.bytes_received > 0 and info.bytes_sent > 0
        # after a step, both stages hold updated weights that differ from the seeded init
        fresh = Stage(run, 0).state_dict()
        params = {p.name: decode(p.tensor) for p in pipe.clients[0].parameters(0).parameters}
        assert not torch.equal(params["embed_tokens.weight"], fresh["embed_tokens.weight"])
        pipe.close()
    finally:
        for p in procs:
            p.stop()
    assert all(p.popen.returncode == 0 for p in procs)


class TimedCaller(StaticCaller):
    """The static pipeline's caller, noting when each call of each step began and ended."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[int, str, float, float]] = []  # (step, kind, began, ended)
        self.lock = threading.Lock()

    def _timed(self, kind: str, name: str, call):
        began = time.monotonic()
        try:
            return call()
        finally:
            if not name.startswith("val"):  # (a validation pass's calls are not a step's)
                with self.lock:
                    self.calls.append((int(name.split(".")[0]), kind, began, time.monotonic()))

    def forward(self, stage, samples, name, *args, **kwargs):
        return self._timed(
            "forward", name, lambda: super(TimedCaller, self).forward(stage, samples, name, *args, **kwargs)
        )

    def backward(self, stage, samples, name, *args, **kwargs):
        return self._timed(
            "backward", name, lambda: super(TimedCaller, self).backward(stage, samples, name, *args, **kwargs)
        )

    def overlapped(self) -> list[int]:
        """The steps whose first call began before the previous step's last call ended."""
        first, last = {}, {}
        for step, _, began, ended in self.calls:
            first[step] = min(first.get(step, began), began)
            last[step] = max(last.get(step, ended), ended)
        return [s for s in sorted(first) if s - 1 in last and first[s] < last[s - 1]]


def test_delayed_updates_send_the_next_steps_microbatches_before_the_last_ones_end_and_train_alike(processes, tmp_path):
    """Two microbatches a step, four in flight, fresh workers for each way. Without delayed updates a
    step's microbatches go out only after the previous step's last backward; with them, at once, and
    every step still trains on its own (the stages count each step's gradients apart). Its gradients
    are up to a step stale: after 40 steps at tiny.toml's learning rate the loss was 8 to 14% above
    synchronous training's (benchmarks/pipeline.py --delayed-updates measures it)."""
    steps = 40
    run, path = write_config(tmp_path, "delayed", 2, eval_every=0, global_batch=16, micro_batch=8)
    records, overlapped = {}, {}
    for delayed in (False, True):
        procs, addresses = start_pipeline(path, 2, tmp_path)
        try:
            caller = TimedCaller(run, addresses)
            progress = RunLog(steps, desc=f"delayed updates {delayed}")
            records[delayed] = run_training(run, caller, progress, steps, inflight=4, overlap=delayed)
            overlapped[delayed] = caller.overlapped()
            check = StaticCaller(run, addresses)
            assert [c.parameters(k).optimizer_steps for k, c in enumerate(check.clients)] == [steps, steps]
            check.close()
        finally:
            for p in procs:
                p.stop()
    assert overlapped[False] == [], overlapped[False]
    assert len(overlapped[True]) >= steps // 2, overlapped[True]
    assert [r["step"] for r in records[True]] == list(range(steps))
    sync, delayed = final_loss(records[False]), final_loss(records[True])
    assert delayed < 0.65 * records[True][0]["loss"], f"delayed updates did not train: {delayed:.4f}"
    assert delayed < 1.25 * sync, f"delayed updates: loss {delayed:.4f} vs {sync:.4f} synchronous"


def test_delayed_updates_are_refused_where_spot_checks_would_misjudge_them_and_without_stages(processes, tmp_path):
    """A replica may answer a delayed step's call before or after its own step, so two honest replicas
    could disagree: a trainer of a swarm whose run checks answers refuses --delayed-updates before it
    joins; --local has no stages to delay."""
    coordinator, url = start_coordinator(CONFIGS / "tiny.toml", tmp_path / "coordinator.log")
    try:
        result = run_cli("train", "--coordinator", url, "--steps", "1", "--delayed-updates")
        assert result.returncode == 2, result.stderr[-3000:]
        assert "--delayed-updates" in result.stderr and "--verify-fraction 0" in result.stderr, result.stderr[-3000:]
    finally:
        coordinator.stop()
    result = run_cli("train", "--local", "--config", str(CONFIGS / "tiny.toml"), "--delayed-updates")
    assert result.returncode == 2 and "--delayed-updates is for --peers or --coordinator" in result.stderr
    assert "Traceback" not in result.stderr
