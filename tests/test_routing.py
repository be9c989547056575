"""The routing policy sends each microbatch to the peer expected to finish it first, and bans failing peers.

Everything runs on explicit `now` values (a virtual clock): no sleeping, no threads.
"""

import heapq
import math

import pytest

from swarm.routing import Lanes, PeerStats, Router, backoff


def measured(router: Router, speeds: dict[str, float], now: float = 0.0) -> None:
    """Teach the router each peer's speed with one completed call."""
    for peer, speed in speeds.items():
        router.done(peer, samples=10, seconds=10 / speed, now=now)


def simulate(speeds: dict[str, float], calls: int, in_flight: int = 8, samples: int = 4) -> dict[str, int]:
    """Discrete-event run: keep `in_flight` microbatches outstanding until `calls` have been routed.

    Each peer serves its calls one after another at its true speed, which the router only learns through `done`.
    Returns how many calls each peer received.
    """
    router = Router()
    router.update_peers({peer: 0.0 for peer in speeds}, now=0.0)
    free_at = dict.fromkeys(speeds, 0.0)  # when each peer finishes the work it already has
    counts = dict.fromkeys(speeds, 0)
    events: list[tuple[float, int, str, float]] = []  # (finish, seq, peer, service seconds)
    sent = 0

    def send(now: float) -> None:
        nonlocal sent
        peer = router.pick(samples, now)
        assert peer is not None
        service = samples / speeds[peer]
        finish = max(now, free_at[peer]) + service
        free_at[peer] = finish
        counts[peer] += 1
        heapq.heappush(events, (finish, sent, peer, service))
        sent += 1

    for _ in range(in_flight):
        send(0.0)
    while events:
        now, _, peer, service = heapq.heappop(events)
        router.done(peer, samples, service, now)
        if sent < calls:
            send(now)
    return counts


def test_backoff_doubles_from_base_up_to_cap():
    assert [backoff(n, 1.0, 10.0) for n in range(1, 7)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert backoff(0, 1.0, 10.0) == 0.0
    assert backoff(5, 0.5, 60.0) == 8.0


def test_backoff_survives_huge_failure_counts():
    assert backoff(10_000, 1.0, 60.0) == 60.0


def test_fastest_idle_peer_is_picked():
    router = Router()
    router.update_peers({"a": 0.0, "b": 0.0, "c": 0.0}, now=0.0)
    measured(router, {"a": 2.0, "b": 8.0, "c": 4.0})
    assert router.pick(4, now=1.0) == "b"


def test_announced_throughput_is_used_until_observed():
    router = Router()
    router.update_peers({"a": 2.0, "b": 5.0}, now=0.0)
    assert router.pick(1, now=0.0) == "b"
    router.done("b", samples=1, seconds=1.0, now=1.0)  # b turns out to do 1 sample/s, slower than a claims
    assert router.pick(1, now=1.0) == "a"


def test_ties_are_broken_by_peer_id():
    router = Router()
    router.update_peers({"zed": 3.0, "amy": 3.0, "kim": 3.0}, now=0.0)
    assert router.pick(3, now=0.0) == "amy"
    assert router.pick(3, now=0.0) == "kim"
    assert router.pick(3, now=0.0) == "zed"


def test_pick_reserves_work_so_in_flight_microbatches_spread_over_peers():
    router = Router()
    router.update_peers({"fast": 2.0, "slow": 1.0}, now=0.0)
    # fast finishes at 1, 2, 3 ...; slow at 2, 4 ...: the third microbatch goes to slow (tie at 2, "fast" < "slow").
    picks = [router.pick(2, now=0.0) for _ in range(6)]
    assert picks == ["fast", "fast", "slow", "fast", "fast", "slow"]
    assert {s.peer_id: s.outstanding for s in router.stats(now=0.0)} == {"fast": 8, "slow": 4}


@pytest.mark.parametrize(
    "speeds",
    [{"fast": 3.0, "slow": 1.0}, {"p4": 4.0, "p2": 2.0, "p1": 1.0}],
    ids=["3:1", "4:2:1"],
)
def test_picks_split_in_proportion_to_throughput_with_microbatches_in_flight(speeds):
    counts = simulate(speeds, calls=400)
    assert sum(counts.values()) == 400
    total_speed = sum(speeds.values())
    for peer, speed in speeds.items():
        assert counts[peer] / 400 == pytest.approx(speed / total_speed, abs=0.05), counts


def test_router_learns_speeds_from_done_only():
    router = Router()
    router.update_peers({"a": 0.0}, now=0.0)
    router.pick(6, now=0.0)
    router.done("a", samples=6, seconds=2.0, now=2.0)
    assert router.stats(now=2.0)[0].throughput == 3.0  # the first observation replaces the guess
    router.pick(6, now=2.0)
    router.done("a", samples=6, seconds=6.0, now=8.0)
    assert router.stats(now=8.0)[0].throughput == pytest.approx(0.3 * 1.0 + 0.7 * 3.0)


def test_new_unmeasured_peer_is_picked_early():
    router = Router()
    router.update_peers({"a": 0.0, "b": 0.0}, now=0.0)
    measured(router, {"a": 10.0, "b": 5.0})
    router.update_peers({"a": 0.0, "b": 0.0, "zz-new": 0.0}, now=1.0)
    picks = [router.pick(5, now=1.0) for _ in range(2)]
    assert "zz-new" in picks  # treated as fast as the best peer, so it gets traffic right away


def test_new_unmeasured_peer_is_tried_even_when_announced_peers_are_fast():
    router = Router()
    router.update_peers({"a": 100.0, "new": 0.0}, now=0.0)
    assert [router.pick(10, now=0.0) for _ in range(2)] == ["a", "new"]


def test_unmeasured_peers_default_to_one_sample_per_second_when_nobody_is_known():
    router = Router()
    router.update_peers({"a": 0.0}, now=0.0)
    assert router.stats(now=0.0)[0].throughput == 1.0
    assert router.stats(now=0.0)[0].measured is False


def test_update_peers_keeps_observed_stats_of_peers_that_stay():
    router = Router()
    router.update_peers({"a": 1.0}, now=0.0)
    measured(router, {"a": 7.0})
    router.update_peers({"a": 50.0, "b": 1.0}, now=1.0)
    assert router.stats(now=1.0)[0] == PeerStats("a", 7.0, 0, 0, None, measured=True)


def test_update_peers_forgets_departed_peers_and_their_bans():
    router = Router()
    router.update_peers({"a": 1.0, "b": 1.0}, now=0.0)
    router.failed("a", samples=1, now=0.0)
    router.failed("a", samples=1, now=0.0)
    assert router.is_banned("a", now=1.0)
    router.update_peers({"b": 1.0}, now=1.0)
    assert router.peers == ["b"]
    assert not router.is_banned("a", now=1.0)
    # It rejoins: no memory of the ban, it starts afresh.
    router.update_peers({"a": 1.0, "b": 1.0}, now=1.0)
    assert router.stats(now=1.0)[0] == PeerStats("a", 1.0, 0, 0, None)
    assert router.pick(1, now=1.0) == "a"


def test_departed_peer_is_never_picked():
    router = Router()
    router.update_peers({"fast": 100.0, "slow": 1.0}, now=0.0)
    router.update_peers({"slow": 1.0}, now=0.0)
    assert {router.pick(1, now=float(t)) for t in range(20)} == {"slow"}
    router.update_peers({}, now=20.0)
    assert router.pick(1, now=20.0) is None


def test_failed_bans_with_exponential_backoff_capped_at_ban_max():
    router = Router(ban_base_s=1.0, ban_max_s=5.0)
    router.update_peers({"a": 1.0}, now=0.0)
    bans = []
    now = 0.0
    for _ in range(5):
        assert router.pick(1, now) == "a"
        ban = router.failed("a", samples=1, now=now)
        bans.append(ban)
        assert router.is_banned("a", now + ban - 1e-9)
        assert not router.is_banned("a", now + ban)
        now += ban
    assert bans == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_banned_peer_is_not_picked_until_the_ban_expires():
    router = Router(ban_base_s=2.0)
    router.update_peers({"a": 10.0, "b": 1.0}, now=0.0)
    assert router.pick(1, now=0.0) == "a"
    assert router.failed("a", samples=1, now=0.0) == 2.0
    assert router.pick(1, now=0.0) == "b"
    router.done("b", samples=1, seconds=1.0, now=1.0)
    assert router.pick(1, now=1.9) == "b"
    assert router.pick(1, now=2.0) == "a"  # the ban is over: it may answer again


def test_failing_again_after_a_ban_doubles_it_and_a_success_resets_the_backoff():
    router = Router(ban_base_s=1.0)
    router.update_peers({"a": 1.0}, now=0.0)
    assert router.failed("a", samples=1, now=0.0) == 1.0
    assert router.pick(1, now=1.0) == "a"
    assert router.failed("a", samples=1, now=1.0) == 2.0
    assert router.pick(1, now=3.0) == "a"
    router.done("a", samples=1, seconds=0.5, now=3.5)
    assert router.stats(now=3.5)[0].failures == 0
    assert router.failed("a", samples=1, now=4.0) == 1.0


def test_calls_in_flight_together_that_fail_together_count_as_one_failure():
    router = Router(ban_base_s=1.0, ban_max_s=60.0)
    router.update_peers({"a": 1.0}, now=0.0)
    for _ in range(8):  # eight calls sent at once, all held by the peer's optimizer step
        router.pick(1, now=0.0)
    bans = [router.failed("a", samples=1, now=1.0 + i * 0.01, started=0.0) for i in range(8)]
    assert bans[0] == 1.0 and all(ban <= 1.0 for ban in bans)
    assert router.stats(now=1.1)[0].failures == 1
    assert router.stats(now=1.1)[0].outstanding == 0
    # A call sent after that failure was learned, failing again, does escalate the back-off.
    router.pick(1, now=2.0)
    assert router.failed("a", samples=1, now=3.0, started=2.0) == 2.0


def test_success_lifts_a_ban_at_once():
    router = Router()
    router.update_peers({"a": 1.0}, now=0.0)
    router.pick(1, now=0.0)
    router.pick(1, now=0.0)
    router.failed("a", samples=1, now=0.5)
    assert router.is_banned("a", now=0.6)
    router.done("a", samples=1, seconds=1.0, now=0.6)  # the other call in flight answered after all
    assert not router.is_banned("a", now=0.6)


def test_stats_show_ban_and_failures_of_each_peer():
    router = Router(ban_base_s=3.0)
    router.update_peers({"b": 2.0, "a": 1.0}, now=0.0)
    router.failed("b", samples=1, now=10.0)
    assert router.stats(now=11.0) == [PeerStats("a", 1.0, 0, 0, None), PeerStats("b", 2.0, 0, 1, 13.0)]
    assert router.stats(now=13.0)[1].banned_until is None


def test_exclude_retries_on_another_peer_of_the_stage():
    router = Router()
    router.update_peers({"a": 10.0, "b": 1.0, "c": 2.0}, now=0.0)
    first = router.pick(1, now=0.0)
    assert first == "a"
    router.failed(first, samples=1, now=0.5)
    assert router.pick(1, now=0.5, exclude={"a", "c"}) == "b"


def test_pick_returns_none_when_every_peer_is_excluded_or_banned():
    router = Router()
    router.update_peers({"a": 1.0, "b": 1.0}, now=0.0)
    router.failed("a", samples=1, now=0.0)
    assert router.pick(1, now=0.0, exclude=["b"]) is None
    assert router.pick(1, now=0.0, exclude=["a", "b"]) is None
    router.failed("b", samples=1, now=0.0)
    assert router.pick(1, now=0.0) is None
    assert [s.outstanding for s in router.stats(now=0.0)] == [0, 0]  # a refused pick reserves nothing


def test_when_every_peer_is_banned_the_first_to_come_back_is_asked_if_banned_ok():
    router = Router(ban_base_s=1.0)
    router.update_peers({"a": 1.0, "b": 1.0, "c": 1.0}, now=0.0)
    for _ in range(3):
        router.failed("a", samples=1, now=0.0)  # banned 4 s
    router.failed("b", samples=1, now=0.0)  # banned 1 s
    router.failed("c", samples=1, now=0.0)
    router.failed("c", samples=1, now=0.0)  # banned 2 s
    assert router.pick(1, now=0.5) is None
    assert router.pick(1, now=0.5, banned_ok=True) == "b"
    assert router.pick(1, now=0.5, exclude={"b"}, banned_ok=True) == "c"
    assert router.pick(1, now=0.5, exclude={"a", "b", "c"}, banned_ok=True) is None
    assert Router().pick(1, now=0.0, banned_ok=True) is None


def test_a_calls_deadline_is_a_few_times_its_peers_slowest_recent_call():
    router = Router()
    router.update_peers({"a": 1.0}, now=0.0)
    assert router.deadline("a", floor=1.0, cap=30.0) == 30.0  # nothing measured yet: the cap
    assert router.deadline("gone", floor=1.0, cap=30.0) == 30.0
    router.answered("a", 0.1)
    assert router.deadline("a", floor=1.0, cap=30.0) == 1.0  # fast answers: the floor
    router.answered("a", 2.0)  # a call that waited for the stage's optimizer step
    assert router.deadline("a", floor=1.0, cap=30.0) == pytest.approx(8.0)
    for _ in range(10):
        router.answered("a", 0.1)
    assert 4.0 < router.deadline("a", floor=1.0, cap=30.0) < 8.0  # it is forgotten slowly
    router.answered("a", 100.0)
    assert router.deadline("a", floor=1.0, cap=30.0) == 30.0
    router.answered("a", float("nan"))  # garbage is ignored
    assert router.deadline("a", floor=1.0, cap=30.0) == 30.0


def test_pick_with_no_peers_returns_none():
    assert Router().pick(1, now=0.0) is None


def test_done_on_idle_peer_resets_its_busy_estimate_to_now():
    router = Router()
    router.update_peers({"a": 1.0, "b": 1.0}, now=0.0)
    assert router.pick(10, now=0.0) == "a"  # a expected busy until 10
    router.done("a", samples=10, seconds=1.0, now=1.0)  # it was 10x faster: idle at 1, 10 samples/s
    assert router.pick(10, now=1.0) == "a"


def test_done_keeps_busy_estimate_while_work_is_still_outstanding():
    router = Router()
    router.update_peers({"a": 1.0, "b": 1.0}, now=0.0)
    assert [router.pick(1, now=0.0) for _ in range(3)] == ["a", "b", "a"]  # a busy until 2, b until 1
    router.done("a", samples=1, seconds=1.0, now=1.0)  # a still holds one sample until 2
    assert router.stats(now=1.0)[0].outstanding == 1
    assert router.pick(1, now=1.0) == "b"


def test_done_and_failed_on_unknown_peers_are_no_ops():
    router = Router()
    router.update_peers({"a": 1.0}, now=0.0)
    before = router.stats(now=0.0)
    router.done("ghost", samples=1, seconds=1.0, now=1.0)
    assert router.failed("ghost", samples=1, now=1.0) == 0.0
    assert router.stats(now=0.0) == before
    assert router.peers == ["a"]


def test_reply_from_a_departed_call_does_not_crash_or_go_negative():
    router = Router()
    router.update_peers({"a": 1.0}, now=0.0)
    router.pick(5, now=0.0)
    router.update_peers({}, now=1.0)
    router.done("a", samples=5, seconds=1.0, now=2.0)
    router.update_peers({"a": 1.0}, now=3.0)
    router.failed("a", samples=5, now=4.0)  # an old call to the previous incarnation of "a"
    assert router.stats(now=4.0)[0].outstanding == 0


@pytest.mark.parametrize("samples", [0, -1])
def test_samples_below_one_raise(samples):
    router = Router()
    router.update_peers({"a": 1.0}, now=0.0)
    with pytest.raises(ValueError):
        router.pick(samples, now=0.0)
    with pytest.raises(ValueError):
        router.done("a", samples, seconds=1.0, now=0.0)
    with pytest.raises(ValueError):
        router.failed("a", samples, now=0.0)


@pytest.mark.parametrize("seconds", [0.0, -1.0, math.nan])
def test_non_positive_duration_is_treated_as_tiny(seconds):
    router = Router()
    router.update_peers({"a": 1.0}, now=0.0)
    router.done("a", samples=1, seconds=seconds, now=0.0)
    throughput = router.stats(now=0.0)[0].throughput
    assert math.isfinite(throughput) and throughput > 1e3


def test_garbage_announcements_count_as_unmeasured():
    router = Router()
    router.update_peers({"a": 4.0, "neg": -3.0, "nan": math.nan}, now=0.0)
    assert {s.peer_id: s.throughput for s in router.stats(now=0.0)} == {"a": 4.0, "nan": 4.0, "neg": 4.0}


@pytest.mark.parametrize("kwargs", [{"ema_alpha": 0.0}, {"ema_alpha": 1.5}, {"ban_base_s": 0.0}, {"ban_max_s": 0.5}])
def test_bad_router_options_raise(kwargs):
    with pytest.raises(ValueError):
        Router(**kwargs)


def test_lanes_pair_each_replica_with_one_of_the_next_stage_and_keep_the_pair():
    lanes = Lanes()
    previous, current = {"a0", "b0"}, {"a1", "b1"}
    assert lanes.partner(1, "a0", previous, current) is None and lanes.taken(1) == set()
    lanes.pin(1, "a0", "b1")
    assert lanes.partner(1, "a0", previous, current) == "b1"
    # b0 is not paired yet: it avoids the replica a0 feeds.
    assert lanes.partner(1, "b0", previous, current) is None and lanes.taken(1) == {"b1"}
    lanes.pin(1, "b0", "a1")
    assert lanes.partner(1, "b0", previous, current) == "a1" and lanes.taken(1) == {"a1", "b1"}
    assert lanes.partner(2, "a1", current, {"a2"}) is None  # stages pair apart


def test_a_lane_ends_when_either_replica_leaves_and_moves_when_its_call_went_elsewhere():
    lanes = Lanes()
    lanes.pin(1, "a0", "a1")
    lanes.pin(1, "b0", "b1")
    # b1 left stage 1: b0's pair ends, a0's stays.
    assert lanes.partner(1, "b0", {"a0", "b0"}, {"a1"}) is None
    assert lanes.taken(1) == {"a1"} and lanes.partner(1, "a0", {"a0", "b0"}, {"a1"}) == "a1"
    # a0 left stage 0: its pair ends too, and a1 is free for a newcomer.
    assert lanes.partner(1, "c0", {"b0", "c0"}, {"a1", "c1"}) is None and lanes.taken(1) == set()
    # A call that failed on the partner and went to another replica moves the lane there.
    lanes.pin(1, "c0", "a1")
    lanes.pin(1, "c0", "c1")
    assert lanes.partner(1, "c0", {"c0"}, {"a1", "c1"}) == "c1" and lanes.taken(1) == {"c1"}
