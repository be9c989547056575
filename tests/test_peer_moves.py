"""What a peer's moves leave behind, with real processes: a peer that moves between stages again and
again (the test-only `--restless`) runs as many threads and child processes after its last move as
after its first, although every stage it served was called by many callers at once."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from swarm.client import StageClient
from swarm.config import load_config
from swarm.ready import PeerReady, read_ready
from tests.processes import group_members, member_client, wait_for_state
from tests.test_swarm import TINY, Swarm, online_names, peer_record

MOVES = 8
CALLERS = 16  # calls at once: the stage server runs a thread for each


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def next_stage(ready_file: Path, after: PeerReady | None, timeout: float = 90) -> PeerReady:
    """The peer's ready file once it names another stage than `after` (it is rewritten at each move)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready = read_ready(ready_file, PeerReady)
        if ready is not None and (after is None or ready.stage != after.stage):
            return ready
        time.sleep(0.05)
    raise AssertionError(f"the peer did not move within {timeout} s (it serves stage {after and after.stage})")


def call_at_once(client: StageClient, stage: int) -> int:
    """CALLERS calls for the stage's weights at the same time; how many were answered (the peer may
    be moving on meanwhile)."""

    def one(_) -> bool:
        try:
            client.parameters(stage)
        except grpc.RpcError:
            return False
        return True

    with ThreadPoolExecutor(CALLERS) as pool:
        return sum(pool.map(one, range(CALLERS)))


def test_a_peer_that_keeps_moving_leaves_no_threads_or_processes_behind(tmp_path):
    config = tmp_path / "restless.toml"
    config.write_text(TINY.read_text() + "\n[rebalance]\nperiod_s = 3.0\n")
    run = load_config(config)
    swarm = Swarm(tmp_path, config)
    ready_file = tmp_path / "r.ready"
    try:
        peer = swarm.add_peer("r", 0, "--restless", "--ready-file", str(ready_file))
        state = wait_for_state(swarm.url, lambda s: "r" in online_names(s), timeout=90)
        client = member_client(swarm.url, run, peer_record(state, "r"))  # the port stays across moves
        counts, answered, ready = [], 0, None
        for _ in range(MOVES):
            ready = next_stage(ready_file, ready)
            answered += call_at_once(client, ready.stage)
            counts.append((threads(peer.popen.pid), len(group_members(peer.popen.pid))))
        client.close()
        assert answered >= CALLERS, f"only {answered} calls answered: the stages were not called"
        # From the first move on (hivemind's own threads and processes have started by then), each
        # move ends what the stage before it ran. A count taken right after a burst of calls wobbles
        # by up to 5 threads that are still ending (31 to 36 in one run), so the last three moves'
        # mean is held to the first three's: before the old servers' pools were shut down it grew by
        # 3 to 6 a move, 12 or more between the two means.
        early, late = [c[0] for c in counts[1:4]], [c[0] for c in counts[-3:]]
        assert sum(late) / 3 <= sum(early) / 3 + 4, f"threads after each move: {[c[0] for c in counts]}"
        assert max(c[1] for c in counts[2:]) <= counts[1][1], f"processes after each move: {[c[1] for c in counts]}"
    finally:
        swarm.close()
