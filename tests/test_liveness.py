"""Who is still there: pings through real DHT nodes (`answering`, `reconnect`), and a 2 x 2 swarm
with averaging and rebalancing that loses a peer and goes on without stalling or thrashing."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
from hivemind.utils.crypto import RSAPrivateKey

from coordinator.ca import RunCA
from peer.daemon import DHT_READ_TIMEOUT_S
from peer.service import start_server
from peer.worker import StageWorker
from swarm.children import processes
from swarm.config import load_config
from swarm.records import (
    REFRESH_S,
    answering,
    get,
    make_dht,
    reconnect,
    shutdown_dht,
    started_dht,
    visible_maddrs,
)
from swarm.trainer import Membership, SwarmCaller, step_hold_s
from swarm.verify import SpotChecks
from swarm.wire import encode
from tests.conftest import CONFIGS
from tests.harness import ACCUMULATION, Swarm, assert_no_gradient_applied_twice, peer_record, swarm_fixture
from tests.processes import free_port, survivors, wait_for_output, wait_for_state
from tests.test_averaging import FAST_AVERAGING, config_with


@swarm_fixture
def nodes():
    first = make_dht()
    others = [make_dht(visible_maddrs(first), record_key=RSAPrivateKey()) for _ in range(2)]
    dhts = [first, *others]
    yield dhts
    for dht in dhts:
        if dht.is_alive():
            shutdown_dht(dht)


def test_live_nodes_answer_a_ping_and_a_stopped_one_does_not(nodes):
    a, b, c = nodes
    ids = [b.peer_id.to_bytes(), c.peer_id.to_bytes()]
    assert answering(a, ids) == set(ids)
    shutdown_dht(c)
    started = time.monotonic()
    assert answering(a, ids, timeout=2.0) == {b.peer_id.to_bytes()}
    # Bounded by the timeout, whatever the dead node does; the margin is for a loaded machine.
    assert time.monotonic() - started < 2.0 + 8.0
    assert answering(a, []) == set()


def test_a_node_not_ready_in_time_is_ended_with_its_p2pd_and_the_error_says_so(nodes, monkeypatch):
    """A node whose only initial peer is frozen (its p2pd stopped: it takes connections and never
    answers) waits out hivemind's ping timeout (3 s) before it is ready. With a shorter startup
    deadline, make_dht ends each attempt, its DHT process and the p2pd it started, and then says
    so instead of waiting; so does `started_dht` (the nodes that are no member's)."""
    frozen = nodes[2]
    (daemon,) = child_pids(frozen.pid)
    # The p2pds this test starts inherit a mark of its own: those of other tests running beside it
    # (pytest -n) are not its to count.
    mark = uuid.uuid4().hex
    monkeypatch.setenv(P2PD_MARK, mark)
    children_before = set(child_pids(os.getpid()))

    def nothing_left() -> None:
        assert set(child_pids(os.getpid())) <= children_before, "a stuck node's DHT process outlived it"
        deadline = time.monotonic() + 5
        while p2pd_pids(mark) and time.monotonic() < deadline:
            time.sleep(0.1)  # an orphaned p2pd is reaped by init, not by us
        assert not p2pd_pids(mark), "a stuck node's p2pd outlived it"

    os.kill(daemon, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"did not start within 1 s, 2 times in a row \(initial peers: /ip4/"):
            make_dht(visible_maddrs(frozen), record_key=RSAPrivateKey(), startup_timeout=1.0)
        assert time.monotonic() - started < 2 * 1.0 + 20.0  # the margin is for a loaded machine
        nothing_left()
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"a DHT node did not start within 1 s"):
            started_dht(1.0, initial_peers=visible_maddrs(frozen), ensure_bootstrap_success=False)
        assert time.monotonic() - started < 1.0 + 15.0
        nothing_left()
    finally:
        os.kill(daemon, signal.SIGCONT)
    with pytest.raises(ValueError, match="startup_timeout"):
        make_dht(startup_timeout=0)


def child_pids(parent: int) -> list[int]:
    return [pid for pid, _, ppid, _ in processes() if ppid == parent]


P2PD_MARK = "SWARM_TEST_P2PD_MARK"


def p2pd_pids(mark: str) -> list[int]:
    """Live p2pd daemons on this machine started with `mark` in their environment's P2PD_MARK."""
    tag = f"{P2PD_MARK}={mark}".encode()
    return [
        pid
        for pid, state, _, _ in processes()
        if state != "Z" and _command(pid) == "p2pd" and tag in _environment(pid).split(b"\0")
    ]


def _environment(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def test_a_bounded_get_gives_up_at_once_when_its_dht_process_ends_under_it(nodes):
    """A get that waits on a frozen node (its p2pd stopped: it takes connections and never answers)
    while the reader's own DHT process ends under it, as SIGTERM to a peer's process group ends it:
    hivemind's future of the get is never resolved, and a peer's loop waited in it with no end. `get`
    with a bound says so within its poll, and before that still answers."""
    reader, _, frozen = nodes
    assert get(reader, "nothing-here", timeout=30) is None  # an answer: nothing stored there
    (daemon,) = child_pids(frozen.pid)
    os.kill(daemon, signal.SIGSTOP)
    try:
        outcome: dict = {}

        def read() -> None:
            try:
                outcome["value"] = get(reader, "nothing-here", timeout=60)
            except TimeoutError as err:
                outcome["error"] = str(err)
            outcome["at"] = time.monotonic()

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        time.sleep(1.0)  # the get waits on the frozen node (hivemind waits 3 s for a call)
        assert thread.is_alive(), f"the get did not wait on the frozen node: {outcome}"
        ended = time.monotonic()
        for pid in [reader.pid, *child_pids(reader.pid)]:
            os.kill(pid, signal.SIGTERM)
        thread.join(30)
        assert not thread.is_alive(), "the get still waits for a DHT process that ended"
        assert "its process ended" in outcome.get("error", ""), outcome
        assert outcome["at"] - ended < 10.0  # GET_POLL_S; the margin is for a loaded machine
    finally:
        os.kill(daemon, signal.SIGCONT)


def test_reconnect_pings_the_nodes_at_the_addresses_it_is_given(nodes):
    a, b, c = nodes
    maddrs = visible_maddrs(b) + visible_maddrs(c)
    assert reconnect(a, maddrs) == 2
    shutdown_dht(c)
    assert reconnect(a, maddrs, timeout=2.0) == 1
    assert reconnect(a, ["/not/an/address"]) == 0


@pytest.fixture
def stage1(nodes, tmp_path):
    """A real stage-1 worker serving on loopback over mutual TLS, and a trainer's SwarmCaller on a real
    DHT node whose routing the test sets itself (no refresh from the DHT). Yields (caller, notes,
    worker, address, peer id): `notes` collects the caller's status notes."""
    run = load_config(CONFIGS / "tiny.toml")
    ca = RunCA.load_or_create(tmp_path, run.run_id)
    worker = StageWorker(run, 1, torch.device("cpu"))
    peer = ca.member("peer")
    server, _, port = start_server(worker, "127.0.0.1", 0, member=peer)
    members = Membership(run, nodes[0], [], SpotChecks(run.stages.count, 0.0), refresh_s=3600.0)
    notes: list[str] = []
    caller = SwarmCaller(run, members, notes.append, ca.member("trainer"), call_timeout=30.0)
    yield caller, notes, worker, f"127.0.0.1:{port}", peer.peer_id
    caller.close()
    members.close()
    server.stop(0)
    worker.close()


def route(caller: SwarmCaller, stage: int, addresses: dict[str, str]) -> None:
    with caller.members.stage(stage) as (router, routed):
        router.update_peers({peer: 1.0 for peer in addresses}, time.monotonic())
        routed.clear()
        routed.update(addresses)


def test_when_every_live_peer_of_a_stage_failed_once_the_trainer_asks_again_without_waiting(stage1):
    """Stage 1 lists two peers: one gone (its port is closed; its record would live out its TTL) and one
    live that times out once (a real gRPC deadline). Both fail within one call; the call goes round
    again and gets its answer from the live one, and the trainer never says it waits for a peer."""
    pipe, notes, _, live, live_id = stage1
    gone = f"127.0.0.1:{free_port()}"
    route(pipe, 1, {"gone": gone, live_id: live})
    asked: list[str] = []

    def info(client):
        asked.append(client.address)
        first = asked.count(client.address) == 1
        return client.info(timeout=1e-4 if first else 10.0)  # the live peer's first answer comes too late

    response, peer = pipe.call(1, 1, info)
    assert peer == live_id and response.stage == 1
    assert set(asked[:2]) == {gone, live} and asked[-1] == live, asked  # both failed once, then went round
    assert not [n for n in notes if "waiting" in n], notes
    assert pipe.failures == len(asked) - 1


def test_a_call_held_while_its_stage_steps_is_not_cut_off(stage1):
    """The router has seen the peer answer in milliseconds; then the stage holds the next call for a
    few seconds, as it does while it looks for its replicas and waits for the other stages' gradient
    norms. The call must wait for it: cut off and sent again, it would be computed twice."""
    pipe, _, worker, live, live_id = stage1
    run = pipe.run
    route(pipe, 1, {live_id: live})
    x = encode(torch.randn(2, run.model.seq_len, run.model.d_model))
    targets = encode(torch.randint(0, run.model.vocab_size, (2, run.model.seq_len)))

    def forward(client):
        return client.forward(1, x, "probe", 0, targets=targets, train=False)

    for _ in range(5):
        pipe.call(1, 2, forward, timed=False)
    with pipe.members.stage(1) as (router, _):
        assert router.deadline(live_id, floor=0.0, cap=30.0) < 1.0  # fast answers so far
    held = 3.0
    assert held < step_hold_s(run)
    worker.lock.acquire()  # the compute thread stops, as during an optimizer step
    threading.Timer(held, worker.lock.release).start()
    started = time.monotonic()
    response, peer = pipe.call(1, 2, forward, timed=False)
    assert peer == live_id and response.loss > 0
    assert time.monotonic() - started >= held * 0.9  # it was held, and waited for
    assert pipe.failures == 0


MOVE = r"moving from stage (\d) to stage (\d)"


def test_losing_one_peer_of_a_two_by_two_swarm_costs_one_peer(processes, tmp_path):
    """Averaging and rebalancing on. After b1 is killed: a1 steps alone at once (hivemind's tracker
    lists b1 until its record expires, and an all-reduce looking for it would wait averaging_timeout_s,
    set to 120 s here so that such a wait cannot pass unseen); nobody moves back and forth: after
    the loss at most one peer moves; no step is lost, none applied twice; b1 leaves no process
    behind and its record vanishes from the DHT by itself."""
    extra = FAST_AVERAGING + "averaging_timeout_s = 120.0\n\n[rebalance]\nperiod_s = 4.0\n"
    path, run = config_with(tmp_path, extra)
    swarm = Swarm(tmp_path, path)
    try:
        names = ["a0", "b0", "a1", "b1"]
        for name in names:
            swarm.add_peer(name, int(name[1]), rebalance=True)
        swarm.wait_online(names)
        steps = 12  # 6 before the kill, 6 after it
        swarm.train(steps=steps, inflight=4, timeout=60)
        swarm.wait_steps(6)
        victim = swarm.peers["b1"]
        # Moves before the loss do not count: on a loaded machine the peers' measured capacities and
        # start times differ, and the swarm may rebalance before it is whole.
        logged = {n: len(swarm.peers[n].output()) for n in names}
        victim.stop(signal.SIGKILL)  # the whole group: worker, DHT node, p2pd
        killed_after = len(swarm.records())
        assert not survivors(victim.popen.pid)
        # Its record expires by itself (TTL_S, 12 s); a loaded machine refreshes views late, so wait long.
        wait_for_state(swarm.url, lambda s: peer_record(s, "b1") is None, timeout=90)
        records = swarm.finish_training(timeout=600)

        assert [r["step"] for r in records] == list(range(steps))
        assert records[-1]["microbatches"] == steps * ACCUMULATION
        assert_no_gradient_applied_twice(swarm)
        after = records[killed_after - 1 :]
        gaps = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(after[:-1], after[1:], strict=True)]
        # A step that waited out the all-reduce would take over 120 s; a loaded machine takes a few.
        assert max(gaps) < run.averaging.averaging_timeout_s / 2, gaps
        moves = {n: re.findall(MOVE, swarm.peers[n].output()[logged[n] :]) for n in names if n != "b1"}
        assert sum(map(len, moves.values())) <= 1, moves
        assert "Traceback" not in swarm.trainer.output()
    finally:
        swarm.close()


def test_the_trainer_closes_the_channel_of_a_peer_it_stopped_calling_and_keeps_its_bytes(stage1):
    """A peer's client lives while the trainer calls it; once unused for longer than any call lasts
    (swarm/trainer/clients.py) its channel is closed, the bytes it carried stay counted, and a later
    call to the peer gets a new one."""
    pipe, _, _, live, live_id = stage1
    route(pipe, 1, {live_id: live})
    pipe.call(1, 1, lambda c: c.info())
    (client,) = pipe.clients.values()
    wire = pipe.bytes_on_wire()
    assert wire > 0
    pipe.clients.drop_idle(time.monotonic() + pipe.call_timeout)  # still within any call's time: kept
    assert pipe.clients.values() == [client]
    pipe.clients.drop_idle(time.monotonic() + pipe.clients.idle_s)
    assert len(pipe.clients) == 0 and pipe.bytes_on_wire() == wire
    with pytest.raises(ValueError, match="closed channel"):
        client.info()
    response, _ = pipe.call(1, 1, lambda c: c.info())
    assert response.stage == 1 and pipe.clients.values() != [client] and pipe.bytes_on_wire() > wire


PEERS = {"a0": 0, "a1": 1}


def test_sigterm_ends_peers_whose_dht_reads_wait_on_a_frozen_node(processes, tmp_path):
    """The coordinator's whole group frozen (SIGSTOP: its DHT node keeps its connections open and never
    answers, as a machine that hangs), every DHT read of a peer's loop waits on it. SIGTERM to a peer's
    group then ends its DHT process under a read in flight, and that read waited with no end: neither
    peer had left a minute later. Now each leaves at once, and cleanly."""
    swarm = Swarm(tmp_path)
    frozen = False
    try:
        # With a DHT of three nodes, one frozen, a peer's reads mostly wait on it (with four peers they
        # found answers elsewhere, and the signal rarely came during one).
        for name, stage in PEERS.items():
            swarm.add_peer(name, stage)
        swarm.wait_online(list(PEERS))
        swarm.coordinator.signal_group(signal.SIGSTOP)
        frozen = True
        time.sleep(2 * REFRESH_S)  # the peers' loops read through the frozen node
        stopped_at = time.monotonic()
        for name in PEERS:
            swarm.peers[name].signal_group(signal.SIGTERM)
        for name, stage in PEERS.items():
            peer = swarm.peers[name]
            try:
                peer.popen.wait(DHT_READ_TIMEOUT_S + 15)  # at worst a read's bound, then the leave
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} still running {time.monotonic() - stopped_at:.0f} s after SIGTERM")
            print(f"{name} exited {time.monotonic() - stopped_at:.1f} s after SIGTERM, its coordinator frozen")
            assert peer.popen.returncode == 0, peer.output()[-3000:]
            assert f"peer {name}: left stage {stage}" in peer.output(), peer.output()[-3000:]
    finally:
        if frozen:
            swarm.coordinator.signal_group(signal.SIGCONT)
        swarm.close()


def test_sigterm_while_a_peer_takes_its_stages_state_ends_it_at_once(processes, tmp_path):
    """A peer still starting (here taking its stage's state, made slow with --state-delay, as a large
    stage over a home link) ends on SIGTERM at once, cleanly, with its DHT node and p2pd: the start
    ran on to its end, then the peer left (a benchmark's stop waited 15 s for one and SIGKILLed it)."""
    swarm = Swarm(tmp_path)
    try:
        swarm.add_peer("a0", 0)
        swarm.wait_online(["a0"])
        slow = swarm.add_peer("slow", 0, "--state-delay", "60")
        wait_for_output(slow, "joining stage 0", timeout=60)
        time.sleep(1.0)  # into the state's download
        stopped_at = time.monotonic()
        slow.signal_group(signal.SIGTERM)
        try:
            slow.popen.wait(15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the starting peer still ran {time.monotonic() - stopped_at:.0f} s after SIGTERM")
        assert slow.popen.returncode == 0, slow.output()[-3000:]
        assert "peer slow: stopped while starting" in slow.output(), slow.output()[-3000:]
        # The averagers' processes (forked from the peer's, with its handlers) must not raise it too.
        # hivemind's own objects cut short mid-start may still print their errors on the way out.
        assert "StoppedWhileStarting" not in slow.output(), slow.output()[-3000:]
        assert not survivors(slow.popen.pid, timeout=10), "the peer's DHT node or p2pd outlived it"
    finally:
        swarm.close()
