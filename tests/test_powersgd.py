"""PowerSGD averaging (`[averaging] compression = "powersgd"`, peer/hivemind_compat.py CappedPowerSGDAverager):
real replicas of stage 1, each on a DHT node of its own, driven step by step in one process. A mean
gradient of low rank comes through the two rank-r factors whole, the replicas end every round with
the same bits, the bytes are a fraction of the uncompressed all-reduce's, and what a round leaves
out comes through in the next ones (error feedback)."""

from __future__ import annotations

import pytest
import torch

from peer.averaging import SwarmUpdater
from swarm.model import Stage
from tests.test_averaging import FAST_AVERAGING, StageOne, config_with
from tests.test_diloco import take_step, weights

RANK = 4


def stage_one_with(tmp_path, rank: int) -> StageOne:
    extra = FAST_AVERAGING + f'compression = "powersgd"\nrank = {rank}\nsync_timeout_s = 1.0\n'
    _, run = config_with(tmp_path, extra)
    return StageOne(run)


@pytest.fixture
def stage_one(tmp_path):
    stage = stage_one_with(tmp_path, RANK)
    yield stage
    stage.close()


def low_rank_gradient(run, seed: int, rank: int = 1) -> list[torch.Tensor]:
    """A gradient for stage 1's parameters whose every matrix has rank `rank`, its directions of
    strength 1, 1/2, 1/4, ... (vectors: any values)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for p in Stage(run, 1).parameters():
        if p.ndim < 2:
            out.append(torch.randn(p.shape, generator=g) * 1e-3)
            continue
        u = torch.randn(p.shape[0], rank, generator=g) * torch.tensor([0.5**k for k in range(rank)])
        v = torch.randn(rank, p[0].numel(), generator=g)
        out.append((u @ v).reshape(p.shape) * 1e-3)
    return out


def averaged(replica: SwarmUpdater) -> list[torch.Tensor]:
    """The gradient the replica's last round applied (the averager's buffers keep it until the next)."""
    averager = replica.opt.grad_averager
    with averager.get_tensors() as tensors:
        by_param = {id(p): t.clone() for p, t in zip(averager.parameters, tensors, strict=True)}
    return [by_param[id(p)] for p in replica.module.parameters()]  # (the buffers go by optimizer group)


def relative(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = sum(float((x - y).pow(2).sum()) for x, y in zip(a, b, strict=True))
    return (num / sum(float(y.pow(2).sum()) for y in b)) ** 0.5


def test_a_low_rank_mean_comes_through_whole_in_a_fraction_of_the_bytes_and_the_replicas_agree(processes, stage_one):
    run = stage_one.run
    a = stage_one.replica(stage_one.node(stage=1))
    b = stage_one.replica(stage_one.node(stage=1))
    half = run.training.global_batch // 2
    ga, gb = low_rank_gradient(run, 1), low_rank_gradient(run, 2)
    take_step([a, b], [ga, gb], half)
    assert a.last_step["group"] == b.last_step["group"] == 2, (a.last_step, b.last_step)

    # The mean of two rank-1 matrices has rank 2 <= RANK: P Q^T is the mean itself.
    mean = [(x + y) / 2 for x, y in zip(ga, gb, strict=True)]
    got = averaged(a)
    assert relative(got, mean) < 1e-5, relative(got, mean)
    assert all(torch.equal(x, y) for x, y in zip(got, averaged(b), strict=True))
    assert all(torch.equal(x, y) for x, y in zip(weights(a.module), weights(b.module), strict=True))

    # Every byte of a round has one reducer: the two replicas' counts add up to the round's traffic.
    # Uncompressed, each value goes to its reducer and back: 2 x 4 bytes per value.
    sent = a.last_step["reduced_bytes"] + b.last_step["reduced_bytes"]
    whole = 8 * sum(p.numel() for p in a.module.parameters())
    assert sent < whole / 4, f"{sent:,} bytes against {whole:,} uncompressed"


def test_what_a_round_leaves_out_comes_through_in_the_next_ones(processes, tmp_path):
    stage_one = stage_one_with(tmp_path, rank=1)
    try:
        run = stage_one.run
        a = stage_one.replica(stage_one.node(stage=1))
        b = stage_one.replica(stage_one.node(stage=1))
        half = run.training.global_batch // 2
        # Each replica's matrices have rank 3, so their mean up to 6: more than a rank-1 round sends.
        ga, gb = low_rank_gradient(run, 1, rank=3), low_rank_gradient(run, 2, rank=3)
        mean = [(x + y) / 2 for x, y in zip(ga, gb, strict=True)]
        take_step([a, b], [ga, gb], half)
        applied = averaged(a)
        first = relative(applied, mean)
        assert first > 0.2, f"a rank-1 round of rank-6 matrices came too close to their mean: {first}"
        zero = [torch.zeros_like(x) for x in ga]
        errors = [first]
        for _ in range(3):  # no new gradient: each round sends on part of what the earlier ones left out
            take_step([a, b], [zero, zero], half)
            got = averaged(a)
            assert all(torch.equal(x, y) for x, y in zip(got, averaged(b), strict=True))
            applied = [x + y for x, y in zip(applied, got, strict=True)]
            errors.append(relative(applied, mean))
        print("relative error of the sum applied, round by round:", [f"{e:.3f}" for e in errors])
        assert errors == sorted(errors, reverse=True) and errors[-1] < 0.5 * first, errors
        assert all(torch.equal(x, y) for x, y in zip(weights(a.module), weights(b.module), strict=True))
    finally:
        stage_one.close()
