"""The rebalancing policy: pure, unit-tested without a network."""

import itertools
import random

import pytest

from swarm.rebalance import best_assignment, clearly_better, move_for, should_move
from swarm.records import PeerRecord, SwarmView


def settle(speeds: list[float], stages: int, start: list[int], seed: int = 0, margin: float = 0.1):
    """Peers check one at a time in random order until nobody wants to move: (assignment, moves)."""
    rng, assign = random.Random(seed), list(start)
    for moves in range(100):
        order = list(range(len(speeds)))
        rng.shuffle(order)
        mover = next(((i, k) for i in order if (k := move_for(speeds, assign, i, stages, margin)) is not None), None)
        if mover is None:
            return assign, moves
        peer, target = mover
        assert assign.count(assign[peer]) > 1, "a move emptied a stage"
        assign[peer] = target
    raise AssertionError("peers kept moving")


def min_total(speeds, assign, stages) -> float:
    return min(sum(s for s, a in zip(speeds, assign, strict=True) if a == k) for k in range(stages))


def optimum(speeds, stages) -> float:
    return max(min_total(speeds, a, stages) for a in itertools.product(range(stages), repeat=len(speeds)))


def test_four_equal_peers_on_one_stage_split_two_and_two_then_stay():
    assign, moves = settle([1.0] * 4, 2, [0, 0, 0, 0])
    assert sorted(assign) == [0, 0, 1, 1] and moves == 2
    for i in range(4):  # balanced: nobody moves again
        assert move_for([1.0] * 4, assign, i, 2) is None


@pytest.mark.parametrize("stages, peers", [(2, 4), (2, 6), (3, 6)])
def test_unequal_speeds_end_within_ten_percent_of_the_optimum(stages, peers):
    rng = random.Random(stages * 100 + peers)
    for trial in range(40):
        speeds = [rng.uniform(0.5, 4.0) for _ in range(peers)]
        assign, moves = settle(speeds, stages, [0] * peers, seed=trial)
        assert min_total(speeds, assign, stages) >= 0.9 * optimum(speeds, stages), speeds
        assert moves <= peers


def test_hysteresis_keeps_a_nearly_balanced_swarm_still():
    speeds, assign = [1.0, 1.0, 1.05, 0.9], [0, 0, 1, 1]  # totals 2.0 vs 1.95: within the margin
    assert all(move_for(speeds, assign, i, 2) is None for i in range(4))


def test_the_last_peer_of_a_stage_never_leaves_it():
    speeds, assign = [10.0, 1.0, 1.0], [0, 1, 1]  # stage 0 is far ahead, but has one peer
    assert move_for(speeds, assign, 0, 2) is None


def test_peers_without_a_measured_throughput_do_not_move():
    assert move_for([0.0, 1.0, 1.0], [0, 0, 0], 0, 2) is None


def test_best_assignment_moves_as_few_peers_as_possible():
    assert best_assignment([1.0, 1.0, 1.0, 1.0], [0, 1, 1, 0], 2) == [0, 1, 1, 0]


def test_leximin_fills_empty_stages_one_after_another():
    assert clearly_better([0.0, 1.0, 3.0], [0.0, 0.0, 4.0], 0.1)
    assert not clearly_better([2.0, 2.1], [2.0, 2.1], 0.1)
    assert not clearly_better([2.1, 2.0], [1.95, 2.15], 0.1)


def record(name: str, stage: int, throughput: float, state: str = "online") -> PeerRecord:
    return PeerRecord(peer_id=name, stage=stage, address="127.0.0.1:1", throughput=throughput, state=state)


def test_should_move_reads_the_swarm_view():
    peers = [record(n, 0, 1.0) for n in "abcd"]
    view = SwarmView(stages=[peers, []], trainers=[], read_at=0.0)
    targets = [should_move(view, p) for p in peers]
    assert targets.count(1) == 2 and targets.count(None) == 2  # every peer sees the same plan
    joining = record("e", 0, 1.0, state="joining")
    assert should_move(view, joining) is None  # not online yet: no opinion


def test_a_peer_in_the_middle_of_a_move_counts_on_its_new_stage():
    stay = [record(n, 0, 1.0) for n in "bc"]
    leaving = record("a", 0, 1.0, state="leaving").model_copy(update={"moving_to": 1})
    # While "a" drains on stage 0, and then while it joins stage 1, nobody else moves to stage 1
    # (both records show up together until the old one expires; online wins over both).
    for stage1 in ([], [record("a", 1, 1.0, state="joining")], [record("a", 1, 1.0)]):
        view = SwarmView(stages=[[*stay, leaving], stage1], trainers=[], read_at=0.0)
        targets = [should_move(view, p) for p in stay]
        assert targets == [None, None], (stage1, targets)
    # A plain leave (no target) is not counted anywhere: the others fill the gap.
    gone = record("a", 1, 1.0, state="leaving")
    view = SwarmView(stages=[stay, [gone]], trainers=[], read_at=0.0)
    assert [should_move(view, p) for p in stay].count(1) == 1
