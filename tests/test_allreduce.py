"""What a stage's all-reduce sends (`[averaging] compression`, peer/allreduce.py): real hivemind
averagers (each its own process, as in a peer) on real DHT nodes over loopback, three replicas of
unequal gradients and weights. With every codec the replicas end with the same bits (the weights
digests compare them), within one encode's error of the exact weighted average; hivemind's own
all-reduce, which hands each member the difference from its own part, leaves them apart."""

from __future__ import annotations

import asyncio
import ctypes
import math
import multiprocessing
import threading
import time
from functools import partial

import hivemind
import pytest
import torch
from hivemind.averaging.control import AveragingStage
from hivemind.compression import CompressionInfo
from hivemind.optim.grad_averager import GradientAverager

from peer.allreduce import COMPRESSIONS, INT8_BLOCK, as_received
from peer.hivemind_compat import CappedGradientAverager
from peer.stage_optimizer import _grad_buffers
from swarm.records import make_dht, shutdown_dht, visible_maddrs

SHAPES = [(300, 70), (1000,), (7,)]  # not whole blocks of 256; a tensor smaller than a block
WEIGHTS = [1.0, 2.0, 5.0]


def gradients(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) * (seed + 1) for shape in SHAPES]


def start_averagers(factory, compression: str, prefix: str, nodes: list, averagers: list) -> None:
    """One averager per entry of WEIGHTS, each on its own DHT node, its gradient accumulated (appended
    to `nodes` and `averagers`, which the caller shuts down)."""
    for i in range(len(WEIGHTS)):
        nodes.append(make_dht(visible_maddrs(nodes[0]) if nodes else None))
        params = [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES]
        for p, g in zip(params, gradients(i), strict=True):
            p.grad = g.clone()
        averagers.append(
            factory(
                params,
                dht=nodes[-1],
                prefix=prefix,
                reuse_grad_buffers=True,
                target_group_size=len(WEIGHTS),
                min_matchmaking_time=2.0,
                request_timeout=1.0,
                compression=COMPRESSIONS[compression],
                averaged_grads=_grad_buffers([{"params": params}]),
                start=True,
            )
        )
        averagers[-1].accumulate_grads_(batch_size=1)


def shut_down(nodes: list, averagers: list) -> None:
    for averager in averagers:
        averager.shutdown()
    for node in nodes:
        shutdown_dht(node)


def average_with(factory, compression: str, prefix: str) -> tuple[list[list[torch.Tensor]], list[torch.Tensor], int]:
    """Each replica's tensors after one round, the exact weighted average, and the bytes the round
    moved (as the members' reducers counted them; 0 for hivemind's own averager, which counts none)."""
    nodes: list[hivemind.DHT] = []
    averagers: list = []
    try:
        start_averagers(factory, compression, prefix, nodes, averagers)
        groups: list = [None] * len(WEIGHTS)

        def step(i: int) -> None:
            groups[i] = averagers[i].step(weight=WEIGHTS[i], timeout=60)

        threads = [threading.Thread(target=step, args=(i,)) for i in range(len(WEIGHTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert all(g is not None and len(g) == len(WEIGHTS) for g in groups), f"groups: {groups}"
        results = []
        for averager in averagers:
            with averager.get_tensors() as tensors:
                results.append([t.clone() for t in tensors])
        moved = sum(int(a.reduced_bytes.value) for a in averagers if hasattr(a, "reduced_bytes"))
    finally:
        shut_down(nodes, averagers)
    grads = [gradients(i) for i in range(len(WEIGHTS))]
    exact = [
        sum(w * g[k].double() for w, g in zip(WEIGHTS, grads, strict=True)) / sum(WEIGHTS) for k in range(len(SHAPES))
    ]
    return results, exact, moved


def capped(params, **kwargs):
    return CappedGradientAverager(params, global_batch=16, **kwargs)


@pytest.mark.parametrize("compression", ["none", "fp16", "int8", "int4"])
def test_replicas_end_a_round_with_the_same_bits_within_one_encode_of_the_average(processes, compression: str):
    results, exact, moved = average_with(capped, compression, f"exact_{compression}")
    # Each value goes to its part's reducer from the 2 other members and its average comes back to
    # them: 4 x the values, at the codec's bytes a value.
    values = sum(math.prod(shape) for shape in SHAPES)
    per_value = moved / (4 * values)
    expected = {"none": 4.0, "fp16": 2.0, "int8": 1 + 4 / 256, "int4": 0.5 + 4 / 256}[compression]
    assert expected <= per_value <= expected * 1.05, f"{compression}: {per_value:.3f} bytes a value"
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b), f"{compression}: replicas differ by up to {(a - b).abs().max().item():.3g}"
    # One encode of a member's part and one of the average: int8 (int4) is off by at most half a step
    # of its block's scale (absmax / 127, / 7), fp16 by 2^-11 of the value; as a bound over all values,
    # one step (or 2^-10) of the largest gradient and of the largest average.
    # hivemind's reducer adds up in float32: "none" is as close as that.
    step = {"none": 2.0**-20, "fp16": 2.0**-10, "int8": 1 / 127, "int4": 1 / 7}[compression]
    largest = max(g.abs().max().item() for i in range(len(WEIGHTS)) for g in gradients(i))
    largest += max(w.abs().max().item() for w in exact)
    for got, want in zip(results[0], exact, strict=True):
        err = (got - want).abs().max().item()
        assert err <= step * largest + 1e-12, f"{compression}: error {err:.3g}, bound {step * largest:.3g}"
    if compression != "none":  # and the codec did round: the test would see a codec that sent float64
        assert max((got - want).abs().max().item() for got, want in zip(results[0], exact, strict=True)) > 1e-9


def test_hiveminds_own_round_leaves_replicas_apart_with_a_lossy_codec(processes):
    """What ExactAllReduceRunner fixes: each member adds its own rounding of the difference."""
    stock = partial(GradientAverager)
    results, _, _ = average_with(stock, "int8", "stock_int8")
    assert any(not torch.equal(a, b) for a, b in zip(results[0], results[1], strict=True))


@pytest.mark.parametrize("compression, levels", [("int8", 127), ("int4", 7)])
def test_block_codec_error_is_bounded_per_block_so_small_blocks_keep_their_precision(compression, levels):
    """A pseudo-gradient's values span orders of magnitude between tensors and within one (a layer's
    norm weights against its matrices). With one scale per 256 values, each value is within half its
    own block's scale: a block of values near 1e-4 beside a block near 1e2 keeps its precision, where
    one scale for the tensor would round it to zero."""
    g = torch.Generator().manual_seed(0)
    magnitudes = torch.tensor([1e2, 1e-4, 3.0, 1e-6]).repeat_interleave(INT8_BLOCK)
    tensor = torch.randn(magnitudes.numel() + 101, generator=g)  # the last block partly filled, odd
    tensor[: magnitudes.numel()] *= magnitudes
    decoded = as_received(COMPRESSIONS[compression], tensor)
    assert decoded.shape == tensor.shape
    for start in range(0, tensor.numel(), INT8_BLOCK):
        block, got = tensor[start : start + INT8_BLOCK], decoded[start : start + INT8_BLOCK]
        bound = block.abs().max() / levels / 2
        assert (got - block).abs().max() <= bound * (1 + 1e-5), (start, (got - block).abs().max(), bound)
        # at most 2 levels + 1 values a block: a codec that sent more bits would not give this
        assert len(set(got.tolist())) <= 2 * levels + 1, (start, len(set(got.tolist())))
    small = slice(INT8_BLOCK, 2 * INT8_BLOCK)  # the 1e-4 block: relative error within half a step
    assert (decoded[small] - tensor[small]).abs().max() / tensor[small].abs().max() <= 1 / (2 * levels) + 1e-6
    per_tensor = tensor.abs().max() / levels  # what one scale for the whole tensor would give that block
    assert (torch.round(tensor[small] / per_tensor) == 0).all(), "the test's small block is not small enough"


@pytest.mark.parametrize("compression", ["int8", "int4"])
def test_a_truncated_block_codec_part_is_refused_with_an_error(compression):
    """A part whose buffer is shorter than its declared size says (a ValueError, which hivemind's
    all-reduce treats as a failed part) instead of reading past its end."""
    codec = COMPRESSIONS[compression]
    serialized = codec.compress(torch.randn(1000), CompressionInfo.from_tensor(torch.randn(1000)))
    serialized.buffer = serialized.buffer[:-1]
    with pytest.raises(ValueError):
        codec.extract(serialized)


class SlowRound(CappedGradientAverager):
    """A member whose all-reduce starts `slow_s` late, long enough for its round to be cancelled
    while it runs (as PartnerWatch cancels a stalled one); records in `raised` whether its step task
    (the averager's, in the averager's process) ended with an exception. Every member of a group is
    of this class: hivemind names its RPCs after the averager's class."""

    def __init__(self, *args, slow_s: float, **kwargs):
        self.slow_s = slow_s
        self.raised = multiprocessing.Value(ctypes.c_int, 0)
        super().__init__(*args, **kwargs)

    async def _aggregate_with_group(self, *args, **kwargs):
        await asyncio.sleep(self.slow_s)
        return await super()._aggregate_with_group(*args, **kwargs)

    async def _step(self, **kwargs):
        try:
            await super()._step(**kwargs)
        except BaseException:
            self.raised.value = 1
            raise


def test_a_round_cancelled_while_its_all_reduce_runs_ends_without_killing_the_averagers_step(processes):
    """The race PartnerWatch meets: it cancels a round just as the round's all-reduce ends. hivemind
    then sets the result of the cancelled step and its step task dies with a traceback in the peer's
    log; the replica must instead step with its own gradient and carry on, and the others of the
    group still get their average."""
    nodes: list[hivemind.DHT] = []
    averagers: list = []
    delays = iter([3.0, 0.0, 0.0])
    try:
        start_averagers(
            lambda params, **kw: SlowRound(params, global_batch=16, slow_s=next(delays), **kw),
            "int8",
            "cancelled",
            nodes,
            averagers,
        )
        controls = [a.step(weight=w, timeout=60, wait=False) for a, w in zip(averagers, WEIGHTS, strict=True)]
        slow = controls[0]
        deadline = time.monotonic() + 30
        while slow.stage != AveragingStage.RUNNING_ALLREDUCE:
            assert time.monotonic() < deadline and not slow.done(), f"the round never began: {slow.stage}"
            time.sleep(0.05)
        assert slow.cancel()
        for control in controls[1:]:  # the others' round completes: the slow member still reduced its part
            assert len(control.result(timeout=60)) == len(WEIGHTS)
        while slow.stage != AveragingStage.FINISHED:  # its step task ends after its part of the all-reduce
            assert time.monotonic() < deadline + 60, f"the cancelled step never finished: {slow.stage}"
            time.sleep(0.05)
        assert slow.cancelled()
        assert averagers[0].raised.value == 0, "the cancelled round's step task died with an exception"
    finally:
        shut_down(nodes, averagers)


def test_a_member_that_never_begins_its_part_is_left_out_at_the_start_timeout_not_the_chunk_timeout(processes):
    """A member the leader counted in the group that never began the all-reduce (its join request failed
    as the leader answered, and it went on looking for a group): here one whose all-reduce begins 12 s
    late. The others leave it out as a sender and as a reducer once `start_timeout` has passed, and end
    the round among themselves, where hivemind waited the whole chunk timeout for its first part."""
    nodes: list[hivemind.DHT] = []
    averagers: list = []
    delays = iter([12.0, 0.0, 0.0])
    controls: list = []
    try:
        start_averagers(
            lambda params, **kw: SlowRound(
                params, global_batch=16, slow_s=next(delays), start_timeout=2.0, next_chunk_timeout=30.0, **kw
            ),
            "none",
            "absent",
            nodes,
            averagers,
        )
        began = time.monotonic()
        controls = [a.step(weight=w, timeout=90, wait=False) for a, w in zip(averagers, WEIGHTS, strict=True)]
        for control in controls[1:]:
            group = control.result(timeout=60)
            assert len(group) == len(WEIGHTS), f"hivemind grouped {len(group)} members, not all three"
        took = time.monotonic() - began
        # The matchmaking, the start timeout and the round; the old runner waited the 12 s.
        assert took < 10.0, f"the present members waited {took:.1f} s for the absent one"
        # Each present member holds, on the parts the present members reduced, the average of the two
        # present ones, and its own values on the absent member's part: the absent member's gradient
        # is in no part. (hivemind's load balancing does not always split the parts evenly: 5% of the
        # values went to the present members' parts in one run, 2/3 in most.)
        grads = [gradients(i) for i in range(len(WEIGHTS))]
        present = [
            sum(WEIGHTS[i] * grads[i][k] for i in (1, 2)) / (WEIGHTS[1] + WEIGHTS[2]) for k in range(len(SHAPES))
        ]
        with_absent = [
            sum(w * g[k] for w, g in zip(WEIGHTS, grads, strict=True)) / sum(WEIGHTS) for k in range(len(SHAPES))
        ]
        for i, averager in enumerate(averagers[1:], start=1):
            with averager.get_tensors() as tensors:
                got = torch.cat([t.flatten() for t in tensors])
            share = torch.isclose(got, torch.cat([t.flatten() for t in present]), atol=1e-5).float().mean()
            own = torch.isclose(got, torch.cat([g.flatten() for g in grads[i]]), atol=1e-5).float().mean()
            assert share > 0, f"no value holds the present members' average ({own:.0%} its own)"
            assert share + own > 0.99, f"{share:.0%} hold the present members' average and {own:.0%} its own"
            wrong = torch.isclose(got, torch.cat([t.flatten() for t in with_absent]), atol=1e-5).float().mean()
            assert wrong < 0.01, f"{wrong:.0%} of the values hold the average with the absent member"
    finally:
        for control in controls:
            if not control.done():
                control.cancel()
        shut_down(nodes, averagers)
