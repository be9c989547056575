"""Starting real swarm processes for tests (swarm.children): each in its own process group, always
cleaned up, ready when its ready file says so."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

from hivemind.utils.crypto import RSAPrivateKey

from swarm import children
from swarm.children import Proc, group_members, http, survivors
from swarm.client import StageClient
from swarm.join import join_dht, join_run
from swarm.net import free_port
from swarm.ready import PeerReady, wait_ready

__all__ = ["Proc", "free_port", "group_members", "http", "survivors"]  # with the helpers below

ROOT = Path(__file__).resolve().parent.parent


class ForkedProc(Proc):
    """A Proc forked from this process's zygote (swarm/zygote.py), which has imported torch and
    hivemind once, whatever the environment says."""

    def forked(self) -> bool:
        return True


def child(args: list[str], log: Path, ready: bool = False) -> Proc:
    """`swarm ARGS`, run from the repository. Peers keep their checkpoints next to the test's logs:
    never in the user's cache, where a later test of the same run id would resume from them."""
    return ForkedProc(args, log, ready=ready, cwd=ROOT, env={"SWARM_CHECKPOINT_DIR": str(log.parent / "checkpoints")})


def start_peer(config: Path | str, stage: int, tmp: Path, *extra: str) -> tuple[Proc, str]:
    """A stage worker on a free loopback port; returns it and its address once it serves."""
    proc = child(
        ["peer", "--config", str(config), "--stage", str(stage), "--port", "0", "--threads", "1", *extra],
        tmp / f"peer-{stage}-{time.monotonic_ns()}.log",
        ready=True,
    )
    try:
        ready = wait_ready(proc, PeerReady, timeout=60)
    except BaseException:
        proc.stop()
        raise
    return proc, ready.address


def start_coordinator(config: Path, log: Path, *extra: str, port: int = 0) -> tuple[Proc, str]:
    """A coordinator on `port` (default: any free one) with its state next to its log; returns it and
    its base URL once it serves. Options in `extra` win over these (argparse keeps the last)."""
    return children.start_coordinator(config, log, *extra, port=port, cwd=ROOT, kind=ForkedProc)


def wait_for_output(proc: Proc, pattern: str, timeout: float = 60) -> re.Match:
    """The first match of `pattern` in what `proc` printed: for a test that a message is shown
    (never to learn that a process is ready: that is its ready file)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, proc.output())
        if m:
            return m
        if not proc.alive():
            raise RuntimeError(f"process exited with {proc.popen.returncode}:\n{proc.output()[-3000:]}")
        time.sleep(0.1)
    raise TimeoutError(f"no line matching {pattern!r} within {timeout} s:\n{proc.output()[-3000:]}")


def wait_for_state(
    base: str, ok: Callable[[dict], bool], timeout: float = 30.0, verify=True, get: Callable[[str], dict] | None = None
) -> dict:
    """The coordinator's /api/v1/state once `ok` says so (`verify`: as httpx takes it, for HTTPS; `get`:
    how to read a URL's JSON from elsewhere, e.g. a node of an emulated internet, `Node.get_json`).
    `timeout`: a bound for a state that should come, not a measure of how soon: the coordinator reads
    the DHT every READ_EVERY_S, and a read on 2 cores shared with the rest of the suite can take seconds."""
    deadline = time.monotonic() + timeout
    while True:
        where = f"{base}/api/v1/state"
        state = get(where) if get is not None else http(verify).get(where).json()
        if ok(state):
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"/api/v1/state did not reach the expected state within {timeout} s: {state}")
        time.sleep(0.2)


def member_dht(url: str, join_token: str | None = None, **options):
    """A DHT node of this test process in the run at `url`, certified as a trainer is (only members
    can use the run's DHT); `options` as for swarm.records.make_dht."""
    return join_dht(url, "trainer", join_token, client_mode=options.pop("client_mode", True), **options)[2]


def member_client(url: str, run, record: dict) -> StageClient:
    """A client of the peer `record` of the run at `url`, calling as a member of that run (a trainer's
    certificate of its own): the stage workers of a run with a coordinator answer members only."""
    member = join_run(url, RSAPrivateKey(), "trainer", run.run_id)
    return StageClient(record["address"], run, member=member, peer_id=record["peer_id"])
