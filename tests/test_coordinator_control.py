"""The operator's control of a run, and a coordinator that dies and comes back, with real processes.

The operator pauses and resumes training and removes a peer through the coordinator's REST API
with a Bearer token; the coordinator stores the decision in the DHT and the trainer and the peers
act on it. A coordinator killed mid-run costs the training nothing, and when it is started again
with the same state directory and ports it finds the swarm at once.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import httpx

from swarm.records import read_control
from tests.harness import TINY, Swarm, online_names, peer_record, swarm_fixture
from tests.processes import free_port, member_dht, start_coordinator, survivors, wait_for_output, wait_for_state

TOKEN = "operator-secret"
OPERATOR = {"Authorization": f"Bearer {TOKEN}"}


def post(url: str, path: str, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{url}{path}", headers=headers or {}, timeout=5)


def wait_until(ok, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        time.sleep(0.2)


@swarm_fixture(scope="module")
def swarm(tmp_path_factory):
    """a0 on stage 0, a1 and b1 on stage 1, and a trainer of 300 steps past its third: one training
    run for the tests of the operator's control, which leave it training."""
    s = Swarm(tmp_path_factory.mktemp("controlled"), coordinator_args=("--token", TOKEN))
    try:
        for name, stage in [("a0", 0), ("a1", 1), ("b1", 1)]:
            s.add_peer(name, stage)
        s.wait_online(["a0", "a1", "b1"])
        s.train(steps=300)
        s.wait_steps(3)
        yield s
    finally:
        s.close()


def test_control_needs_the_operator_token_and_is_off_without_one(processes, tmp_path, monkeypatch):
    monkeypatch.setenv("SWARM_TOKEN", TOKEN)  # the token may come from the environment
    guarded, url = start_coordinator(TINY, tmp_path / "guarded.log")
    monkeypatch.delenv("SWARM_TOKEN")
    unguarded, open_url = start_coordinator(TINY, tmp_path / "open.log")
    dht = member_dht(url)
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
            for path in ("/api/v1/control/pause", "/api/v1/peers/nobody/remove"):
                refused = post(url, path, headers)
                assert refused.status_code == 401, (path, headers, refused.text)
                assert refused.headers["WWW-Authenticate"] == "Bearer"
        time.sleep(2)  # what a wrong token changed, if anything, would be in the DHT by now
        assert not read_control(dht, "tiny").paused

        assert post(url, "/api/v1/control/pause", OPERATOR).json() == {"paused": True}
        wait_until(lambda: read_control(dht, "tiny").paused, 10, "the pause reached the DHT")
        assert post(url, "/api/v1/control/resume", OPERATOR).json() == {"paused": False}
        wait_until(lambda: not read_control(dht, "tiny").paused, 10, "the resume reached the DHT")
        unknown = post(url, "/api/v1/peers/nobody/remove", OPERATOR)
        assert unknown.status_code == 404 and "nobody" in unknown.json()["detail"]

        disabled = post(open_url, "/api/v1/control/pause", OPERATOR)
        assert disabled.status_code == 403
        assert disabled.json()["detail"] == "control is disabled: start the coordinator with --token"
        assert post(open_url, "/api/v1/peers/nobody/remove", OPERATOR).status_code == 403
    finally:
        dht.shutdown()
        assert guarded.stop() == 0 and unguarded.stop() == 0


def test_pause_holds_the_trainer_between_steps_and_resume_lets_it_go(swarm):
    assert post(swarm.url, "/api/v1/control/pause", OPERATOR).json() == {"paused": True}
    wait_for_output(swarm.trainer, r"paused by the operator", timeout=20)
    held = len(swarm.records())
    time.sleep(5)
    assert len(swarm.records()) == held, "the trainer went on while paused"
    assert swarm.trainer.popen.poll() is None

    assert post(swarm.url, "/api/v1/control/resume", OPERATOR).json() == {"paused": False}
    swarm.wait_steps(held + 3, timeout=60)
    steps = [r["step"] for r in swarm.records()]
    assert steps == list(range(len(steps)))  # no step skipped or repeated across the pause


def test_a_removed_peer_leaves_by_itself_and_training_goes_on(swarm):
    victim = swarm.peers["b1"]
    peer_id = peer_record(swarm.wait_online(["a0", "a1", "b1"]), "b1")["peer_id"]
    assert post(swarm.url, f"/api/v1/peers/{peer_id}/remove", OPERATOR).json() == {"removed": peer_id}
    assert victim.popen.wait(timeout=30) == 0, victim.output()[-3000:]
    assert "removed from the run by the operator" in victim.output()
    assert not survivors(victim.popen.pid), "the removed peer left a process behind"
    wait_for_state(swarm.url, lambda s: peer_record(s, "b1") is None, timeout=30)

    done = len(swarm.records())
    swarm.wait_steps(done + 3, timeout=60)
    assert swarm.trainer.popen.poll() is None and "Traceback" not in swarm.trainer.output()
    assert post(swarm.url, "/api/v1/peers/no-such-peer/remove", OPERATOR).status_code == 404


def test_training_outlives_the_coordinator_and_a_restart_finds_the_swarm(processes, tmp_path: Path):
    state_dir = tmp_path / "coordinator-state"
    dht_port = free_port()
    args = ("--state-dir", str(state_dir), "--dht-port", str(dht_port))
    swarm = Swarm(tmp_path, coordinator_args=args)
    try:
        swarm.add_peer("a0", 0)
        swarm.add_peer("a1", 1)
        swarm.wait_online(["a0", "a1"])
        swarm.train(steps=300)
        swarm.wait_steps(3)
        saved = state_dir / "peers.json"
        wait_until(lambda: saved.exists() and len(json.loads(saved.read_text())["dht_addrs"]) >= 2, 10, "peers saved")
        join = httpx.get(f"{swarm.url}/api/v1/join", timeout=5).json()

        dead = swarm.coordinator
        dead.stop(signal.SIGKILL)  # the whole group: the coordinator, its DHT process and p2pd
        assert not survivors(dead.popen.pid)
        done = len(swarm.records())
        swarm.wait_steps(done + 5, timeout=60)  # the trainer and the peers need only the DHT

        port = int(swarm.url.rsplit(":", 1)[1])
        restarted_at = time.monotonic()
        swarm.coordinator, url = start_coordinator(swarm.config, tmp_path / "restarted.log", *args, port=port)
        assert url == swarm.url
        # About 3 s on an idle machine: the saved DHT addresses let it find the swarm at once. The
        # wait is long enough for a loaded one.
        swarm.wait_online(["a0", "a1"], timeout=60)
        print(f"restarted coordinator: both peers listed {time.monotonic() - restarted_at:.1f} s after its launch")
        assert httpx.get(f"{url}/api/v1/join", timeout=5).json()["initial_peers"] == join["initial_peers"]
        assert online_names(httpx.get(f"{url}/api/v1/state", timeout=5).json()) == {"a0", "a1"}
        assert swarm.trainer.popen.poll() is None and "Traceback" not in swarm.trainer.output()
    finally:
        swarm.close()
