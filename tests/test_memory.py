"""Memory-aware stages: checkpointed activations give the same gradients, the memory estimate matches
what a stage really allocates, and a peer refuses a stage its device cannot hold (swarm/memory.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from peer.requests import BackwardWork, ForwardWork
from peer.worker import StageWorker
from swarm import memory
from swarm.config import RunConfig, load_config
from swarm.model import Block, Stage, rotary_tables
from swarm.optim import make_optimizer, param_groups
from swarm.placement import pick_stage
from swarm.rebalance import should_move
from swarm.records import PeerRecord, SwarmView
from tests.conftest import ROOT
from tests.processes import child, start_coordinator, start_peer

TINY = ROOT / "configs" / "tiny.toml"
CPU = torch.device("cpu")


def tiny(stages: int = 3, checkpoint: bool = False) -> RunConfig:
    data = load_config(TINY).with_stages(stages).model_dump()
    data["model"]["checkpoint_activations"] = checkpoint
    return RunConfig.model_validate(data)


def train_middle_stage(run: RunConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A training forward through a real StageWorker of the middle stage, its graph cached, then the
    backward that claims it: the input gradient and the stage's accumulated gradients."""
    worker = StageWorker(run, 1, CPU)
    try:
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(2, run.model.seq_len, run.model.d_model, generator=gen)
        grad = torch.randn(2, run.model.seq_len, run.model.d_model, generator=gen)
        worker.submit(ForwardWork(x, None, True, 0.0, "m", 0)).result(timeout=60)
        cached = worker.claim_cached("m")
        assert cached is not None, "the training forward's graph was not cached"
        input_grad = worker.submit(BackwardWork(None, grad, "m", 0, tuple(x.shape), cached)).result(timeout=60)
        _, grads = worker.named_tensors(with_grads=True)
    finally:
        worker.close()
    return input_grad, grads


def test_checkpointed_activations_give_the_same_gradients_through_a_stage_worker():
    plain_input, plain = train_middle_stage(tiny(checkpoint=False))
    ckpt_input, ckpt = train_middle_stage(tiny(checkpoint=True))
    assert torch.allclose(plain_input, ckpt_input, rtol=1e-5, atol=1e-7)
    assert plain.keys() == ckpt.keys() and plain
    for name in plain:
        assert torch.allclose(plain[name], ckpt[name], rtol=1e-5, atol=1e-7), name


def saved_bytes(module: torch.nn.Module, forward) -> int:
    """Bytes of the distinct tensors autograd saves for backward while `forward()` runs, leaving out
    the module's own weights and buffers (counted apart, as weights)."""
    own = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(seen.values())


def measured_microbatch(run: RunConfig, k: int) -> int:
    """What one training microbatch keeps until its backward on stage `k`: the saved tensors of the
    stage's forward (and, on the last stage, of the loss), and the output a cached graph holds."""
    stage = Stage(run, k).train()
    m, b = run.model, run.training.micro_batch
    last = k == run.stages.count - 1
    x = torch.randint(0, m.vocab_size, (b, m.seq_len)) if k == 0 else torch.randn(b, m.seq_len, m.d_model)
    out = {}

    def forward() -> None:
        out["y"] = stage(x if k == 0 else x.requires_grad_(True))
        if last:
            F.cross_entropy(out["y"].float().transpose(1, 2), torch.zeros(b, m.seq_len, dtype=torch.long))

    saved = saved_bytes(stage, forward)
    return saved if last else saved + out["y"].untyped_storage().nbytes()


@pytest.mark.parametrize("checkpoint", [False, True], ids=["stored", "checkpointed"])
def test_the_activation_estimate_matches_the_saved_tensors_of_every_stage(checkpoint):
    run = tiny(checkpoint=checkpoint)
    for k in range(run.stages.count):
        measured, estimated = measured_microbatch(run, k), memory.microbatch_bytes(run, k, "cpu")
        # Within 1%: the estimate counts every saved tensor of this model's blocks (measured: exact
        # on the first and middle stages, 0.2% under on the last).
        assert abs(estimated - measured) <= 0.01 * measured, (k, estimated, measured)
    # In flight: that much per microbatch, plus (checkpointed) the one block backward rebuilds.
    cos, sin = rotary_tables(run.model)
    block = Block(run.model)
    x = torch.randn(run.training.micro_batch, run.model.seq_len, run.model.d_model, requires_grad=True)
    one_block = saved_bytes(block, lambda: block(x, cos, sin))
    need = memory.estimate(run, 1, "cpu", inflight=3)
    rebuilt = one_block if checkpoint else 0
    assert abs(need.activations - (3 * measured_microbatch(run, 1) + rebuilt)) <= 0.01 * need.activations


def test_checkpointed_activations_keep_a_fraction_of_the_stored_ones():
    stored, ckpt = tiny(checkpoint=False), tiny(checkpoint=True)
    assert measured_microbatch(ckpt, 1) < 0.2 * measured_microbatch(stored, 1)


def test_weights_gradients_and_optimizer_are_the_stage_parameters_times_their_copies():
    run = tiny()
    for k in range(run.stages.count):
        stage = Stage(run, k)
        param_bytes = sum(p.numel() * p.element_size() for p in stage.parameters())
        need = memory.estimate(run, k, "cpu", inflight=1)
        assert need.parameters == sum(p.numel() for p in stage.parameters())
        assert (need.weights, need.grads, need.optimizer) == (param_bytes, 2 * param_bytes, 2 * param_bytes)
        # AdamW's state after a real step: two float32 tensors per parameter.
        opt = make_optimizer(param_groups(stage, run.training.weight_decay), run)
        for p in stage.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim() > 0)
        assert state == need.optimizer
        assert need.total == need.tensors + need.overhead and need.overhead > 0


def test_the_1b_stages_are_counted_without_building_them():
    run = load_config(ROOT / "configs" / "1b.toml")
    total = sum(memory.stage_parameters(run, k) for k in range(run.stages.count))
    assert 0.9e9 < total < 1.0e9  # the config's "~0.97B parameters"
    half = memory.estimate(run, 1, "cuda", inflight=2)
    assert half.activations < memory.estimate(run, 1, "cpu", inflight=2).activations  # bf16 under autocast


def test_a_peer_picks_and_moves_only_to_stages_it_can_hold():
    assert pick_stage([5.0, 0.0, 1.0], [1, 0, 1]) == 1
    assert pick_stage([5.0, 0.0, 1.0], [1, 0, 1], allowed=[0, 2]) == 2
    peers = [PeerRecord(peer_id=n, stage=0, address="127.0.0.1:1", throughput=1.0, state="online") for n in "abcd"]
    view = SwarmView(stages=[peers, []], trainers=[], read_at=0.0)
    movers = [p for p in peers if should_move(view, p) == 1]
    assert len(movers) == 2
    assert [should_move(view, p, allowed=[0]) for p in movers] == [None, None]


def test_a_move_keeps_the_old_stage_only_where_both_stages_fit():
    run = load_config(ROOT / "configs" / "tiny.toml")
    one, two = (memory.estimate(run, k, "cpu", inflight=3).total for k in (0, 1))
    plenty = 10 * (one + two)
    assert memory.fits_beside(run, 0, 1, "cpu", 3, free=plenty, max_memory=None)
    assert memory.fits_beside(run, 0, 1, "cpu", 3, free=plenty, max_memory=one + two)
    # --max-memory caps what the peer takes in all: one stage fits it, both do not.
    assert not memory.fits_beside(run, 0, 1, "cpu", 3, free=plenty, max_memory=one + two - 1)
    # The device has no room left beside the stage it holds.
    assert not memory.fits_beside(run, 0, 1, "cpu", 3, free=two - 1, max_memory=None)


def swarm_peer(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "swarm.cli", "peer", *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout
    )


def test_peer_dry_run_prints_every_stage_estimate_and_exits_by_whether_one_fits(processes):
    done = swarm_peer("--config", str(TINY), "--dry-run", "--device", "cpu", "--inflight", "4")
    assert done.returncode == 0, done.stderr
    for k in range(2):
        need = memory.estimate(load_config(TINY), k, "cpu", inflight=5)
        assert f"stage {k} on cpu" in done.stdout and memory.human(need.total) in done.stdout
    assert done.stdout.count("-> fits") == 2
    small = swarm_peer("--config", str(TINY), "--dry-run", "--device", "cpu", "--max-memory", "0.01")
    assert small.returncode == 1 and small.stdout.count("does not fit: stage") == 2, small.stdout


def test_a_peer_refuses_a_stage_that_does_not_fit_and_serves_one_that_does(processes, tmp_path):
    done = swarm_peer("--config", str(TINY), "--stage", "1", "--device", "cpu", "--max-memory", "0.05")
    assert done.returncode == 2
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: stage 1 needs ") and "MiB available" in line, done.stderr
    assert "--inflight" in line and "checkpoint_activations = true" in line and "another stage" in line
    proc, address = start_peer(TINY, 1, tmp_path, "--max-memory", "4", "--inflight", "4")
    try:
        assert address.startswith("127.0.0.1:")
    finally:
        proc.stop()


def test_a_joining_peer_refuses_a_stage_that_does_not_fit(processes, tmp_path):
    coordinator, url = start_coordinator(TINY, tmp_path / "coordinator.log")
    try:
        peer = child(["peer", "--coordinator", url, "--stage", "0", "--max-memory", "0.05"], tmp_path / "peer.log")
        assert peer.popen.wait(timeout=120) == 2
        assert "error: stage 0 needs " in peer.output(), peer.output()
        auto = child(["peer", "--coordinator", url, "--max-memory", "0.05"], tmp_path / "auto.log")
        assert auto.popen.wait(timeout=120) == 2
        assert "error: stage " in auto.output() and " needs " in auto.output(), auto.output()
    finally:
        coordinator.stop()
