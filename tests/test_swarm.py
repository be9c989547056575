"""The swarm with real processes on loopback: a coordinator, peers found through the DHT, a trainer.

Each test runs its own coordinator and peers of configs/tiny.toml (2 stages) and a trainer process
(`swarm train --coordinator`), then disturbs the swarm while it trains.
"""

from __future__ import annotations

import signal
import time

from tests.harness import ACCUMULATION, TINY, Swarm, assert_no_gradient_applied_twice, peer_record, state, swarm_fixture
from tests.processes import survivors, wait_for_output, wait_for_state


@swarm_fixture
def swarm(tmp_path):
    s = Swarm(tmp_path)
    yield s
    s.close()


def test_traffic_splits_in_proportion_to_peer_speed(processes, tmp_path):
    # Eight microbatches per global batch, all in flight, so that stage 1 is kept busy: with
    # room to spare, the router rightly sends everything to the peer that finishes first.
    config = tmp_path / "busy.toml"
    config.write_text(
        TINY.read_text().replace("global_batch = 16", "global_batch = 32").replace("micro_batch = 8", "micro_batch = 4")
    )
    swarm = Swarm(tmp_path, config)
    try:
        check_traffic_split(swarm)
    finally:
        swarm.close()


def check_traffic_split(swarm: Swarm) -> None:
    swarm.add_peer("s0", 0)
    # Delays long enough to outweigh each call's fixed costs (gRPC, the trainer's own work), which
    # grow on a loaded machine and pull every peer's observed speed toward the same figure.
    swarm.add_peer("fast", 1, "--delay-per-sample", "0.02")
    swarm.add_peer("slow", 1, "--delay-per-sample", "0.08")
    swarm.wait_online(["s0", "fast", "slow"])
    # Spot checks off: a checked call goes to the peer with the fewest passed checks, whatever its
    # speed (swarm/verify.py); this is about where the router alone sends the work.
    # 12 steps: the fast peer's share of the samples settles within 3 (0.65 at step 8, 0.63 at 16).
    swarm.train(12, 8, 20, "--verify-fraction", "0")
    swarm.finish_training()
    s = wait_for_state(swarm.url, lambda s: peer_record(s, "slow")["samples_served"] > 0)
    fast, slow = peer_record(s, "fast"), peer_record(s, "slow")
    share = fast["samples_served"] / (fast["samples_served"] + slow["samples_served"])
    speed = fast["throughput"] / (fast["throughput"] + slow["throughput"])
    assert fast["throughput"] > 1.5 * slow["throughput"], (fast, slow)
    # Round robin would give 0.5; the router's plan, about the share of speed (about 0.8 here).
    assert abs(share - speed) <= 0.2 * speed, f"fast peer's share {share:.2f}, its share of speed {speed:.2f}"


def test_peer_joining_mid_run_gets_traffic(swarm):
    swarm.add_peer("first0", 0)
    swarm.add_peer("first1", 1)
    swarm.wait_online(["first0", "first1"])
    swarm.train(steps=200, inflight=4)
    swarm.wait_steps(3)
    swarm.add_peer("late", 1)
    swarm.wait_online(["late"], timeout=90)
    # The trainer reads the DHT every 2 s and the record refreshes every 4 s: on an idle machine the
    # served samples show within about 10 s; the wait is long so that a loaded one passes too.
    wait_for_state(swarm.url, lambda s: (peer_record(s, "late") or {}).get("samples_served", 0) > 0, timeout=90)
    log = (swarm.tmp / "late.log").read_text()
    assert "weights from peers of stage 1 at step" in log  # a late joiner takes the stage's current state


def test_sigterm_leaves_cleanly_and_the_trainer_loses_nothing(swarm):
    for name, stage in [("a0", 0), ("a1", 1), ("b1", 1)]:
        swarm.add_peer(name, stage)
    swarm.wait_online(["a0", "a1", "b1"])
    steps = 14
    swarm.train(steps=steps, inflight=4)
    swarm.wait_steps(4)
    leaver = swarm.peers["b1"]
    # Exit code 0 means it left by itself: a peer whose leaving hangs exits 1 after EXIT_DEADLINE_S
    # (20 s), and one that ignores SIGTERM is SIGKILLed after 60 s (-9).
    code = leaver.stop(signal.SIGTERM, timeout=60)
    assert code == 0
    assert not survivors(leaver.popen.pid), "the peer left a process behind"
    assert "leaving" in leaver.output()
    records = swarm.finish_training()
    assert records[-1]["microbatches"] == steps * ACCUMULATION
    assert_no_gradient_applied_twice(swarm)


def test_trainer_waits_for_a_missing_stage_and_says_so(swarm):
    swarm.add_peer("only0", 0)
    swarm.wait_online(["only0"])
    swarm.train(steps=5)
    wait_for_output(swarm.trainer, r"waiting for a peer of stage 1", timeout=60)
    assert swarm.trainer.popen.poll() is None  # waiting, not crashed
    swarm.add_peer("late1", 1)
    records = swarm.finish_training()
    assert records[-1]["microbatches"] == 5 * ACCUMULATION


def test_peers_started_on_one_stage_rebalance_two_and_two_and_then_stay(processes, tmp_path):
    period = 3.0
    config = tmp_path / "rebalance.toml"
    config.write_text(TINY.read_text() + f"\n[rebalance]\nperiod_s = {period}\n")
    swarm = Swarm(tmp_path, config)
    try:
        names = ["r0", "r1", "r2", "r3"]
        for name in names:
            # Equal peers: each measures its speed as it starts, and on a loaded machine one that
            # started at a quiet moment measured 166 samples/s against the others' 80, so that 3 + 1
            # was within the move threshold of 2 + 2 and nobody moved again. A delay of 0.05 s per
            # sample (0.1 s a sample's forward and backward) is most of each peer's time, so they
            # announce nearly the same speed however loaded the machine was when each measured.
            swarm.add_peer(name, 0, "--delay-per-sample", "0.05", rebalance=True)
        swarm.wait_online(names)

        def per_stage(s: dict) -> list[int]:
            return [sum(p["state"] == "online" for p in stage["peers"]) for stage in s["stages"]]

        # two check periods (each randomised up to 1.5x) and two joins take about 20 s on an idle
        # machine (`python -m benchmarks rebalance` measures it); the wait is long for a loaded one
        wait_for_state(swarm.url, lambda s: per_stage(s) == [2, 2], timeout=2 * 1.5 * period + 90)
        moves = sum(swarm.peers[n].output().count("moving from stage") for n in names)
        assert moves == 2, f"{moves} moves"
        time.sleep(2 * period)  # every peer checks at least once more (1.5x its period at most): nobody moves
        assert sum(swarm.peers[n].output().count("moving from stage") for n in names) == 2
        assert per_stage(state(swarm.url)) == [2, 2]
    finally:
        swarm.close()
