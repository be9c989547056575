"""Readiness by contract (swarm/ready.py): a real coordinator and real peers started with
`--ready-file` write there, only once they serve, where they serve; the file is never seen half-written."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest

from swarm.client import StageClient
from swarm.config import load_config
from swarm.ready import CoordinatorReady, NotReady, PeerReady, read_ready, wait_ready, write_ready
from tests.conftest import run_cli
from tests.processes import ROOT, child, member_client, wait_for_state

TINY = ROOT / "configs" / "tiny.toml"


def first_call_answers(address: str, stage: int, client: StageClient | None = None) -> None:
    """One Info call, no retry: the server must already serve when the file is there. `client`: one
    of the run's members, for a peer of a run with a coordinator (it answers members only)."""
    client = client or StageClient(address, load_config(TINY), timeout=10)
    try:
        info = client.info(timeout=10)
    finally:
        client.close()
    assert (info.run_id, info.stage) == (load_config(TINY).run_id, stage)


def test_a_stage_served_by_hand_is_ready_where_it_serves(processes, tmp_path: Path):
    proc = child(
        ["peer", "--config", str(TINY), "--stage", "1", "--port", "0", "--threads", "1"], tmp_path / "p.log", ready=True
    )
    try:
        ready = wait_ready(proc, PeerReady, timeout=60)
        first_call_answers(ready.address, 1)
    finally:
        assert proc.stop() == 0, proc.output()[-3000:]
    assert ready.run_id == load_config(TINY).run_id and ready.stage == 1
    assert ready.address.startswith("127.0.0.1:") and ready.peer_id is None


def test_a_coordinator_and_a_peer_of_its_run_are_ready_where_they_serve(processes, tmp_path: Path):
    coordinator = child(
        ["coordinator", "--config", str(TINY), "--port", "0", "--dht-port", "0", "--state-dir", str(tmp_path / "s")],
        tmp_path / "coordinator.log",
        ready=True,
    )
    peer = None
    try:
        ready = wait_ready(coordinator, CoordinatorReady, timeout=60)
        assert httpx.get(f"{ready.url}/healthz", timeout=5).json() == {"ok": True}  # at once, no retry
        assert ready.url == f"http://127.0.0.1:{ready.http_port}" and ready.run_id == load_config(TINY).run_id
        assert ready.dht_maddrs == httpx.get(f"{ready.url}/api/v1/join", timeout=5).json()["initial_peers"]

        args = ["peer", "--coordinator", ready.url, "--stage", "0", "--public-name", "p0", "--threads", "1"]
        peer = child([*args, "--no-rebalance"], tmp_path / "p0.log", ready=True)
        served = wait_ready(peer, PeerReady, timeout=120)
        record = {"address": served.address, "peer_id": served.peer_id}
        first_call_answers(served.address, 0, member_client(ready.url, load_config(TINY), record))

        def online(state: dict) -> dict | None:
            return next((p for p in state["stages"][0]["peers"] if p["state"] == "online"), None)

        record = online(wait_for_state(ready.url, online, timeout=30))
        assert (served.peer_id, served.address, served.public_name) == (record["peer_id"], record["address"], "p0")
        assert served.run_id == ready.run_id and served.stage == 0
    finally:
        for proc in (peer, coordinator):
            if proc is not None:
                proc.stop()


def test_the_ready_file_is_written_whole_or_not_at_all(tmp_path: Path):
    path = tmp_path / "ready.json"
    long_id = "x" * 200_000  # large enough for a plain write to be seen half-done
    stop, seen, torn = threading.Event(), [], []

    def read_while_written() -> None:
        while not stop.is_set():
            try:
                ready = read_ready(path, PeerReady)
            except ValueError as err:
                torn.append(err)
                return
            if ready is not None:
                seen.append(ready.stage)

    reader = threading.Thread(target=read_while_written)
    reader.start()
    try:
        for stage in range(200):
            write_ready(path, PeerReady(run_id=long_id, stage=stage, address="127.0.0.1:1"))
    finally:
        stop.set()
        reader.join()
    assert not torn, torn[0]
    assert seen and read_ready(path, PeerReady).stage == 199
    assert [p.name for p in tmp_path.iterdir()] == ["ready.json"]  # no temporary file left behind


def test_a_process_that_exits_before_it_is_ready_is_reported_with_its_output(processes, tmp_path: Path):
    proc = child(["peer", "--config", str(TINY), "--stage", "7"], tmp_path / "p.log", ready=True)
    try:
        with pytest.raises(NotReady, match=r"exited with 2:\n(.|\n)*--stage: 7 is not a stage"):
            wait_ready(proc, PeerReady, timeout=60)
    finally:
        proc.stop()
    assert not proc.ready_file.exists()


def test_a_ready_file_in_a_missing_folder_is_refused_naming_it(processes, tmp_path: Path):
    missing = tmp_path / "no-such-folder" / "ready.json"
    run = run_cli("coordinator", "--config", str(TINY), "--ready-file", str(missing), timeout=60)
    assert run.returncode == 2 and f"the folder {missing.parent} does not exist" in run.stderr, run.stderr
