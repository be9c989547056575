"""The swarm simulation (benchmarks/swarmsim.py): the real policies at a size no test can start."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.swarmsim import (
    DELAY_CLASSES,
    Device,
    SimOptions,
    Simulation,
    effective_speed,
    oracle,
    petals_choice,
)
from peer.throughput import capacity
from swarm.records import PeerRecord, SwarmView


def run(options: SimOptions) -> Simulation:
    sim = Simulation(options)
    sim.start()
    for _ in range(int(options.minutes * 60 / 4)):
        sim.step()
    return sim


def test_200_peers_with_churn_reach_nine_tenths_of_the_oracle_over_10_minutes():
    # Peers announce compute and link together (peer/throughput.py `capacity`); balanced on their
    # device's benchmark alone, the same swarm reaches 0.86 (seed 1).
    sim = run(SimOptions(peers=200, stages=8, minutes=10, mass_leave_at_min=None, seed=1))
    assert 150 < len(sim.peers) < 250, "churn keeps the population about where it started"
    assert sim.result.ratio >= 0.9, f"achieved ÷ oracle {sim.result.ratio:.3f}"


def test_after_a_departure_that_empties_two_stages_the_real_policy_moves_peers_there_and_the_static_plan_cannot():
    # No churn: nobody joins to fill the two stages; only moves can. Peers read the DHT 0-12 s late:
    # the steadiness once counted every record of a late view as a dead peer's, and peers that read
    # it never moved (nor the peers the plan picked among them).
    base = SimOptions(peers=100, stages=8, minutes=12, session_min=10**6, mass_leave_at_min=4, mass_leave_stages=2)
    moved = run(base)
    static = run(dataclasses.replace(base, policy="static"))
    assert moved.recovery(0.9) <= 300, f"recovered in {moved.recovery(0.9)} s"
    assert static.recovery(0.9) == float("inf")


def test_the_oracle_is_the_best_assignment_for_small_swarms_and_the_even_split_bound_for_large():
    assert oracle([3.0, 1.0, 1.0, 1.0], 2) == 3.0
    assert oracle([1.0] * 100, 8) == pytest.approx(12.5)
    assert oracle([], 8) == 0.0


def test_a_slow_uplink_lowers_a_peers_capacity_and_its_speed_below_its_compute():
    fast_link = capacity(5.0, 1e9, 1e9, 250_000, 250_000)
    slow_link = capacity(5.0, 10e6, 1e9, 250_000, 250_000)
    assert slow_link < fast_link < 5.0
    assert slow_link == pytest.approx(1 / (1 / 5.0 + 8 * 250_000 / 10e6 + 8 * 250_000 / 1e9))
    assert effective_speed(slow_link, 0.1) < slow_link  # and a round trip per microbatch on top


def test_the_real_policy_moves_peers_and_the_static_plan_never_does():
    # A100s and stragglers, no churn: the join choices leave the stages uneven enough for a move.
    devices = (Device("A100", 5.0, 0.5), Device("CPU", 0.2, 0.5))
    base = SimOptions(peers=60, stages=4, minutes=8, mass_leave_at_min=None, session_min=10_000, devices=devices)
    moved = run(base)
    static = run(dataclasses.replace(base, policy="static"))
    assert moved.result.moves >= 1 and static.result.moves == 0, (moved.result.moves, static.result.moves)


def test_petals_moves_only_when_balance_quality_is_below_the_threshold():
    def view(totals: list[list[float]]) -> SwarmView:
        stages = [
            [
                PeerRecord(peer_id=f"p{k}{i}", stage=k, address="", throughput=x, state="online")
                for i, x in enumerate(xs)
            ]
            for k, xs in enumerate(totals)
        ]
        return SwarmView(stages=stages, trainers=[], read_at=0.0)

    assert petals_choice(view([[1.0, 1.0, 1.0], [1.0]]), 0, 1.0, 0.75) == 1  # 1 vs 2 after: quality 0.5
    assert petals_choice(view([[1.0, 1.0], [1.5]]), 0, 1.0, 0.75) is None  # no move lifts the minimum


def test_the_clairvoyant_ceiling_answers_a_departure_at_once_with_a_mover_that_keeps_serving():
    # No churn; a quarter of the peers leaves stage 0 at once after a minute.
    options = SimOptions(
        peers=24, stages=2, minutes=4, session_min=10**6, mass_leave_at_min=1, mass_leave_stages=1, policy="clairvoyant"
    )
    sim = Simulation(options)
    sim.start()
    while sim.result.mass_leave_at is None:
        sim.step()
    movers = [p for p in sim.peers.values() if p.moving_to is not None]
    assert movers and all(p.moving_to == 0 and p.stage == 1 and p.state == "online" for p in movers), movers
    serving = {p.peer_id for p in sim.peers.values() if p.state == "online" and p.stage == 1}
    assert {p.peer_id for p in movers} <= serving  # stage 1 keeps them while they download stage 0
    for _ in range(int((options.minutes - 1) * 60 / 4)):
        sim.step()
    assert sim.result.moves == len(movers), "nothing but the departures made it move"
    assert all(p.moving_to is None for p in sim.peers.values()) and sim.recovery(0.9) <= 120


def test_the_trainer_routes_a_mover_on_its_target_from_the_time_it_announced_before_its_record_says_so():
    # As above; the trainer reads the DHT 8 s late. A mover announces when it will serve stage 0
    # (swarm/records.py `SwarmView.routable`): stage 0's router holds it before the trainer's view
    # shows it online there, and the swarm recovers sooner; without the announcement, never before.
    def run_counting_early(announce: bool) -> tuple[float, int]:
        options = SimOptions(peers=24, stages=2, minutes=4, session_min=10**6, mass_leave_at_min=1, mass_leave_stages=1)
        sim = Simulation(dataclasses.replace(options, policy="clairvoyant", announce_ready=announce))
        sim.start()
        early = 0
        for _ in range(int(options.minutes * 60 / 4)):
            sim.step()
            lagging = {p.peer_id for p in sim.view(DELAY_CLASSES // 2).online(0)}
            early += len(set(sim.routers[0].peers) & {p.peer_id for p in sim.peers.values() if p.stage == 0} - lagging)
        return sim.result.ratio, early

    (silent, never), (announced, early) = run_counting_early(False), run_counting_early(True)
    assert never == 0 and early > 0, (never, early)
    assert announced > silent, (announced, silent)
