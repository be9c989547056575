"""The rebalancing policy: pure, unit-tested without a network."""

import itertools
import random

import pytest
from pydantic import ValidationError

from swarm import rebalance
from swarm.rebalance import (
    Steadiness,
    best_assignment,
    effective_margin,
    move_for,
    moves,
    peer_steadiness,
    planned_moves,
    should_move,
    stage_totals,
)
from swarm.records import REFRESH_S, PeerRecord, SwarmView


def settle(speeds: list[float], stages: int, start: list[int], seed: int = 0, margin: float = 0.1):
    """Peers check one at a time in random order until nobody wants to move: (assignment, moves)."""
    rng, assign = random.Random(seed), list(start)
    for made in range(100):
        order = list(range(len(speeds)))
        rng.shuffle(order)
        mover = next(((i, k) for i in order if (k := move_for(speeds, assign, i, stages, margin)) is not None), None)
        if mover is None:
            return assign, made
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


def test_empty_stages_are_filled_one_after_another():
    speeds, assign = [1.0] * 6, [0] * 6
    assign, moves = settle(speeds, 3, assign)
    assert sorted(assign) == [0, 0, 1, 1, 2, 2] and moves == 4


def test_a_move_that_lifts_only_a_stage_above_the_lowest_is_not_made():
    # Stage 0 is the bottleneck (1.0) whatever happens: moving a peer from stage 2 to stage 1
    # would lift stage 1 alone and cost a download.
    speeds, assign = [1.0, 1.5, 1.0, 1.0], [0, 1, 2, 2]
    assert all(move_for(speeds, assign, i, 3) is None for i in range(4))


def test_one_peer_of_a_two_by_two_swarm_lost_moves_nobody():
    # The survivors of equal speed: either side of 2 + 1 is as good as the other.
    assert all(move_for([1.0, 1.0, 1.0], [0, 0, 1], i, 2) is None for i in range(3))
    # Survivors of unequal speed: one move that lifts the lowest stage (1 -> 2), then none.
    assert [move_for([3.0, 1.0, 1.0], [0, 0, 1], i, 2) for i in range(3)] == [None, 1, None]
    assert settle([3.0, 1.0, 1.0], 2, [0, 0, 1]) == ([0, 1, 1], 1)


def record(name: str, stage: int, throughput: float, state: str = "online", **more) -> PeerRecord:
    return PeerRecord(peer_id=name, stage=stage, address="127.0.0.1:1", throughput=throughput, state=state, **more)


def test_moves_weigh_the_measured_capacity_not_the_speed_of_the_moment():
    # Right after a failure the lone peer of stage 1 serves at its fastest (its batches are full)
    # and the stage-0 peers idle: by the speeds of that moment stage 0 is the bottleneck.
    busy = [record("a", 0, 0.4, capacity=1.0), record("b", 0, 0.4, capacity=1.0)]
    lone = record("c", 1, 2.0, capacity=1.0)
    view = SwarmView(stages=[busy, [lone]], trainers=[], read_at=0.0)
    assert [should_move(view, p) for p in [*busy, lone]] == [None, None, None]


def test_a_swarm_is_steady_once_its_membership_held_still_and_every_record_is_fresh():
    steady = Steadiness(settle_s=12.0, max_age_s=8.0)
    peers = [record(n, k, 1.0, updated=100.0) for n, k in [("a", 0), ("b", 0), ("c", 1), ("d", 1)]]

    def view(records, now):
        return SwarmView(stages=[[p for p in records if p.stage == k] for k in (0, 1)], trainers=[], read_at=now)

    assert not steady.observe(view(peers, 100.0), 100.0)  # first sight: not yet held still
    fresh = [p.model_copy(update={"updated": 108.0}) for p in peers]
    assert not steady.observe(view(fresh, 108.0), 108.0)
    fresh = [p.model_copy(update={"updated": 112.0}) for p in peers]
    assert steady.observe(view(fresh, 112.5), 112.5)
    # "d" dies: its record stops being refreshed. Once it is older than max_age_s, nobody acts.
    dead = fresh[3]
    alive = [p.model_copy(update={"updated": 120.5}) for p in fresh[:3]]
    assert steady.observe(view([*alive, dead], 120.0), 120.0)  # 8 s: it might still be a slow refresh
    assert not steady.observe(view([*alive, dead], 121.0), 121.0)
    # Its record expires: the membership changed, and it must hold still again for settle_s.
    alive = [p.model_copy(update={"updated": 124.0}) for p in alive]
    assert not steady.observe(view(alive, 124.5), 124.5)
    alive = [p.model_copy(update={"updated": 132.0}) for p in alive]
    assert not steady.observe(view(alive, 132.5), 132.5)
    alive = [p.model_copy(update={"updated": 136.0}) for p in alive]
    assert steady.observe(view(alive, 136.5), 136.5)


def swarm_of(n: int, stages: int, updated: float) -> list[PeerRecord]:
    return [record(f"p{i:04d}", i % stages, 1.0, updated=updated) for i in range(n)]


def view_of(records: list[PeerRecord], stages: int, now: float) -> SwarmView:
    return SwarmView(stages=[[p for p in records if p.stage == k] for k in range(stages)], trainers=[], read_at=now)


def test_a_large_swarm_is_steady_through_the_churn_of_the_moment_a_small_one_is_not():
    for n, steady_with_churn in [(1000, True), (40, False)]:
        steady = peer_steadiness()
        peers = swarm_of(n, 8, updated=100.0)
        assert not steady.observe(view_of(peers, 8, 100.0), 100.0)  # first sight
        later = [p.model_copy(update={"updated": 112.0}) for p in peers]
        assert steady.observe(view_of(later, 8, 112.5), 112.5)
        # One peer left (its record expired), one joined: what churn does every few seconds.
        churned = [*later[1:], record("new", 0, 0.0, state="joining", updated=116.0)]
        churned = [p.model_copy(update={"updated": 116.0}) for p in churned]
        assert steady.observe(view_of(churned, 8, 116.5), 116.5) is steady_with_churn, n
        # A tenth of the swarm gone at once is no churn: nobody acts until it has held still for a
        # refresh period, in which every live peer re-announced itself.
        gone = churned[n // 10 :]
        assert not steady.observe(view_of(gone, 8, 120.5), 120.5)
        assert not steady.observe(view_of(gone, 8, 120.5 + REFRESH_S - 0.5), 120.5 + REFRESH_S - 0.5)
        refreshed = [p.model_copy(update={"updated": 120.0 + REFRESH_S}) for p in gone]
        assert steady.observe(view_of(refreshed, 8, 120.5 + REFRESH_S), 120.5 + REFRESH_S)


def test_a_view_late_as_a_whole_is_steady_a_dead_peers_record_in_it_is_not():
    steady = Steadiness(settle_s=12.0, max_age_s=8.0)
    peers = swarm_of(4, 2, updated=100.0)
    steady.observe(view_of(peers, 2, 100.0), 100.0)
    # Read 12 s after they were written (a slow DHT): every record is as old as the others.
    assert steady.observe(view_of(peers, 2, 112.0), 112.0)
    late = [*[p.model_copy(update={"updated": 109.0}) for p in peers[:3]], peers[3]]  # "p0003" stopped
    assert not steady.observe(view_of(late, 2, 121.0), 121.0)


def test_the_plan_for_all_peers_is_each_peers_own_decision():
    rng = random.Random(3)
    for _ in range(50):
        speeds = [rng.choice([0.05, 1.0, 2.2, 3.5, 5.0]) for _ in range(rng.randint(2, 7))]
        assign = [rng.randrange(3) for _ in speeds]
        assert rebalance.moves(speeds, assign, 3) == [move_for(speeds, assign, i, 3) for i in range(len(speeds))]
    peers = [record("a", 0, 1.0), record("b", 0, 1.0), record("c", 0, 1.0), record("d", 1, 1.0)]
    view = view_of(peers, 2, 0.0)
    plan = planned_moves(view)
    assert plan == {p.peer_id: t for p in peers if (t := should_move(view, p)) is not None} and len(plan) == 1


def test_a_joiner_goes_where_the_peers_still_downloading_are_counted():
    # Stage 1 has the least online, but a joiner of capacity 2 is already downloading it.
    peers = [record("a", 0, 2.0), record("b", 1, 1.0), record("c", 1, 0.0, state="joining", capacity=2.0)]
    view = view_of(peers, 2, 0.0)
    assert view.stage_throughputs() == [2.0, 1.0]
    assert stage_totals(view) == [2.0, 3.0]


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


def test_a_peer_that_serves_its_stage_while_it_loads_the_next_counts_on_the_next():
    # Make before break (peer/daemon.py `PeerDaemon.move`): "a" is online on stage 0 with `moving_to` 1
    # while it loads stage 1. The trainers still call it on stage 0 (the view's online peers), and the
    # plan counts it on stage 1: nobody else moves there, and it is not asked to move again.
    stay = [record(n, 0, 1.0) for n in "bc"]
    mover = record("a", 0, 1.0, moving_to=1)
    view = SwarmView(stages=[[*stay, mover], []], trainers=[], read_at=0.0)
    assert [p.peer_id for p in view.online(0)] == ["b", "c", "a"]
    assert stage_totals(view) == [2.0, 1.0]
    assert [should_move(view, p) for p in [*stay, mover]] == [None, None, None]
    # Without the target, the same records send one of the others to stage 1 as well.
    still = SwarmView(stages=[[*stay, record("a", 0, 1.0)], []], trainers=[], read_at=0.0)
    assert [should_move(still, p) for p in stay].count(1) == 1


def test_a_mover_is_routed_on_its_stage_until_the_time_it_announced_then_on_its_target():
    # The trainers' view of "a" is its record as it began to move: online on stage 0, loading stage 1,
    # ready by t = 50 (swarm/records.py `SwarmView.routable`). Their views lag: from t = 50 they send
    # it stage 1's calls, at the capacity it measured for stage 1, and no more of stage 0's.
    mover = record("a", 0, 3.0, capacity=2.0, moving_to=1, ready_at=50.0)
    view = SwarmView(stages=[[record("b", 0, 1.0), mover], [record("c", 1, 1.0)]], trainers=[], read_at=0.0)
    routed = {
        t: [[(p.peer_id, p.stage, p.throughput) for p in view.routable(k, t)] for k in range(2)] for t in (49, 50)
    }
    assert routed[49] == [[("b", 0, 1.0), ("a", 0, 3.0)], [("c", 1, 1.0)]]
    assert routed[50] == [[("b", 0, 1.0)], [("c", 1, 1.0), ("a", 1, 2.0)]]
    assert all(p.moving_to is None and p.ready_at is None for p in view.routable(1, 50))
    # Once its new record is in the view, it is routed by that one, once; a peer that moves without
    # saying when, or that stops serving first (leaving), is routed by its records alone.
    arrived = record("a", 1, 2.5)
    later = SwarmView(stages=[[record("b", 0, 1.0), mover], [record("c", 1, 1.0), arrived]], trainers=[], read_at=0.0)
    assert [(p.peer_id, p.throughput) for p in later.routable(1, 60)] == [("c", 1.0), ("a", 2.5)]
    silent = record("a", 0, 3.0, moving_to=1)
    leaving = record("a", 0, 3.0, state="leaving", moving_to=1, ready_at=50.0)
    for other in (silent, leaving):
        v = SwarmView(stages=[[other], [record("c", 1, 1.0)]], trainers=[], read_at=0.0)
        assert [[p.peer_id for p in v.routable(k, 60)] for k in range(2)] == [[] if other is leaving else ["a"], ["c"]]


def test_a_record_with_an_impossible_ready_time_is_refused():
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValidationError, match="ready_at"):
            record("a", 0, 1.0, moving_to=1, ready_at=bad)


def test_a_large_swarm_moves_a_few_peers_to_a_stage_that_lost_many_and_none_for_a_small_loss():
    # 8 stages x 20 peers of mixed speeds: too many for the exhaustive search.
    speeds = [1.0, 2.2, 3.5, 5.0, 0.05] * 4
    throughputs, current = speeds * 8, [k for k in range(8) for _ in speeds]
    small = best_assignment(throughputs[1:], current[1:], 8)  # stage 0 lost one T4: 2% of its total
    assert small == current[1:]
    throughputs, current = throughputs[5:], current[5:]  # stage 0 lost 5 peers: 25% of its total
    target = best_assignment(throughputs, current, 8)
    moved = [i for i, (a, c) in enumerate(zip(target, current, strict=True)) if a != c]
    totals = [sum(x for x, k in zip(throughputs, target, strict=True) if k == s) for s in range(8)]
    assert 1 <= len(moved) <= 8 and min(totals) > 1.1 * sum(throughputs[:15])


def test_a_stage_of_many_peers_short_by_less_than_the_margin_is_made_up_for_a_stage_of_two_is_not():
    # Stage 0 lost one of its 13 equal peers (8% of its total, less than the 10% margin); the other
    # stages hold 12 such peers and two of half their speed. Half a peer's share of a stage (3.6%) is
    # the margin here: one half-speed peer moves to stage 0 and lifts the lowest total by 4%.
    throughputs = [1.0] * 12 + [1.0] * 12 * 7 + [0.5, 0.5] * 7
    current = [0] * 12 + [k for k in range(1, 8) for _ in range(12)] + [k for k in range(1, 8) for _ in range(2)]
    assert effective_margin(0.1, len(current), 8) == pytest.approx(1 / (2 * len(current) / 8))
    targets = moves(throughputs, current, 8, 0.1)
    assert [t for t in targets if t is not None] == [0], targets
    assert all(throughputs[i] == 0.5 for i, t in enumerate(targets) if t is not None)
    # Two stages of two peers (of one machine, measured apart): 5% apart is noise, the margin stays 10%.
    assert effective_margin(0.1, 4, 2) == 0.1
    assert moves([1.0, 1.0, 0.9, 0.9], [0, 0, 1, 1], 2, 0.1) == [None] * 4


def test_a_large_swarm_all_on_one_stage_is_spread_over_every_stage():
    throughputs = [1.0 + (i % 5) for i in range(40)]
    target = best_assignment(throughputs, [0] * 40, 8)
    totals = [sum(x for x, k in zip(throughputs, target, strict=True) if k == s) for s in range(8)]
    assert min(totals) >= 0.8 * sum(throughputs) / 8
