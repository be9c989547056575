"""The coordinator as a real process: join info, the swarm state it reads from a real DHT, shutdown."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.view import SwarmReader, ViewHolder, empty_view
from swarm.config import ConfigError, load_config
from swarm.join import fetch_join, join_dht
from swarm.records import PeerRecord, TrainerRecord, announce_peer, announce_trainer, make_dht, shutdown_dht
from tests.harness import swarm_fixture
from tests.processes import ROOT, group_members, member_dht, start_coordinator, wait_for_state
from tests.test_exactly_once import until

TINY = ROOT / "configs" / "tiny.toml"
LONG_TTL = 120.0  # records the tests must still see at the end of the module


@swarm_fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc, base = start_coordinator(TINY, tmp_path_factory.mktemp("coordinator") / "coordinator.log")
    yield base
    assert proc.stop() == 0, proc.output()[-3000:]


@pytest.fixture(scope="module")
def join(coordinator: str) -> dict:
    response = httpx.get(f"{coordinator}/api/v1/join", timeout=5)
    assert response.status_code == 200
    return response.json()


@swarm_fixture(scope="module")
def client_dht(coordinator: str, join: dict):
    dht = member_dht(coordinator)
    yield dht
    dht.shutdown()


def test_join_returns_the_config_and_initial_peers(join: dict):
    assert join["run_id"] == "tiny"
    assert join["config"] == load_config(TINY).model_dump()
    assert join["initial_peers"] and all(p.startswith("/ip4/") and "/p2p/" in p for p in join["initial_peers"])
    assert join["version"]


def test_a_byte_tokenizer_run_serves_no_tokenizer_and_joiners_download_nothing(
    coordinator: str, join: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert join["tokenizer_sha256"] is None
    missing = httpx.get(f"{coordinator}/api/v1/tokenizer", timeout=5)
    assert missing.status_code == 404 and "byte tokenizer" in missing.json()["detail"]
    run, _ = fetch_join(coordinator)
    assert run.data.tokenizer == "bytes" and not any(tmp_path.iterdir())


def test_state_lists_announced_peers_and_trainers(coordinator: str, client_dht):
    # A stage record counts only from the peer it names (swarm.records.read_stage): this node's own.
    peer_id, trainer_id = client_dht.peer_id.to_base58(), f"trainer-{uuid.uuid4().hex[:8]}"
    peer = PeerRecord(peer_id=peer_id, stage=1, address="127.0.0.1:1", state="online", throughput=5.0)
    assert announce_peer(client_dht, "tiny", peer, ttl=LONG_TTL)
    assert announce_trainer(client_dht, "tiny", TrainerRecord(trainer_id=trainer_id, steps=3), ttl=LONG_TTL)

    state = wait_for_state(
        coordinator,
        lambda s: (
            any(p["peer_id"] == peer_id for p in s["stages"][1]["peers"])
            and any(t["trainer_id"] == trainer_id for t in s["trainers"])
        ),
    )
    assert state["run_id"] == "tiny" and state["num_stages"] == 2
    stage0, stage1 = state["stages"]
    assert (stage0["index"], stage0["layers"]) == (0, [0, 2])
    assert (stage1["index"], stage1["layers"]) == (1, [2, 4])
    assert stage1["online"] == 1 and stage1["throughput"] == 5.0 and not stage1["bottleneck"]
    assert stage1["peers"][0]["state"] == "online" and stage1["peers"][0]["address"] == "127.0.0.1:1"
    assert stage0["peers"] == [] and stage0["online"] == 0 and stage0["throughput"] == 0.0 and stage0["bottleneck"]
    assert next(t for t in state["trainers"] if t["trainer_id"] == trainer_id)["steps"] == 3
    assert 0 <= state["age_s"] < 60 and state["read_at"] > time.time() - 60  # a view of now, not of long ago


def test_trainers_spot_checks_are_in_state_and_summed_in_metrics(coordinator: str, client_dht):
    spot = {"spot_checks": 7, "spot_disagreements": 3, "spot_bans": 1, "spot_banned": {"liar-peer": 1}}
    records = [
        TrainerRecord(trainer_id=f"spotter-{uuid.uuid4().hex[:8]}", wire_bytes=100, failures=2, **spot),
        TrainerRecord(trainer_id=f"spotter-{uuid.uuid4().hex[:8]}", wire_bytes=50, spot_checks=5),
    ]
    for record in records:
        assert announce_trainer(client_dht, "tiny", record, ttl=LONG_TTL)
    ids = {r.trainer_id for r in records}
    state = wait_for_state(coordinator, lambda s: ids <= {t["trainer_id"] for t in s["trainers"]})
    listed = {t["trainer_id"]: t for t in state["trainers"]}
    for r in records:
        assert listed[r.trainer_id] == {**r.model_dump(), "updated": listed[r.trainer_id]["updated"]}

    # A sum over every trainer listed: the module's other trainers are still listed (none spot-checks).
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{coordinator}/metrics", timeout=5).text)}
    sums = {}
    for name, field in [
        ("swarm_spot_checks", "spot_checks"),
        ("swarm_spot_disagreements", "spot_disagreements"),
        ("swarm_spot_bans", "spot_bans"),
        ("swarm_wire_bytes", "wire_bytes"),
    ]:
        assert families[name].type == "counter" and families[name].documentation, name
        assert [sample.name for sample in families[name].samples] == [f"{name}_total"]
        sums[name] = families[name].samples[0].value
        assert sums[name] == sum(t[field] for t in state["trainers"]), name
    assert (sums["swarm_spot_checks"], sums["swarm_spot_disagreements"], sums["swarm_spot_bans"]) == (12, 3, 1)


def test_expired_records_vanish_from_state(coordinator: str, client_dht):
    peer_id = client_dht.peer_id.to_base58()  # on stage 0 (the test above announced it on stage 1)
    record = PeerRecord(peer_id=peer_id, stage=0, address="127.0.0.1:2", state="joining")
    assert announce_peer(client_dht, "tiny", record, ttl=2.0)

    def listed(state: dict) -> bool:
        return any(p["peer_id"] == peer_id for p in state["stages"][0]["peers"])

    seen = wait_for_state(coordinator, listed)
    assert seen["stages"][0]["online"] == 0  # a joining peer is listed but not counted
    wait_for_state(coordinator, lambda s: not listed(s), timeout=30)  # a bound: it expires 2 s after its store


def test_openapi_docs_health_and_unknown_paths(coordinator: str):
    spec = httpx.get(f"{coordinator}/openapi.json", timeout=5).json()
    assert {"/api/v1/join", "/api/v1/state", "/healthz"} <= set(spec["paths"])
    assert "StateResponse" in spec["components"]["schemas"] and "PeerRecord" in spec["components"]["schemas"]
    assert httpx.get(f"{coordinator}/docs", timeout=5).status_code == 200
    assert httpx.get(f"{coordinator}/healthz", timeout=5).json() == {"ok": True}
    assert httpx.get(f"{coordinator}/api/v1/nothing-here", timeout=5).status_code == 404


def test_sigterm_stops_the_coordinator_and_all_its_children(processes, tmp_path: Path):
    proc, base = start_coordinator(TINY, tmp_path / "coordinator.log")
    pid = proc.popen.pid
    try:
        assert httpx.get(f"{base}/healthz", timeout=5).status_code == 200
        assert len(group_members(pid)) >= 3  # the coordinator, its DHT process and p2pd
        os.kill(pid, signal.SIGTERM)  # the coordinator alone: it must stop its children itself
        code = proc.popen.wait(timeout=10)
    finally:
        proc.stop()
    assert code == 0, proc.output()[-3000:]
    deadline = time.monotonic() + 3
    while group_members(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert group_members(pid) == [], proc.output()[-3000:]
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)
    assert "stopped" in proc.output()


class DroppingFront:
    """An HTTP front of a real coordinator, on its own port: it passes every request on, but closes
    the connection of the first `drop` certificate requests without an answer, as a coordinator
    killed between a joiner's /join and its certificate request leaves it."""

    def __init__(self, coordinator: str, drop: int):
        front = self
        self.drop, self.certificate_calls = drop, 0

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _pass_on(self, method: str) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path == "/api/v1/certificate":
                    front.certificate_calls += 1
                    if front.certificate_calls <= front.drop:
                        self.close_connection = True
                        return
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("authorization", "content-type")}
                answer = httpx.request(method, coordinator + self.path, content=body, headers=headers, timeout=10)
                self.send_response(answer.status_code)
                self.send_header("Content-Type", answer.headers.get("content-type", "application/json"))
                self.send_header("Content-Length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)

            def do_GET(self) -> None:
                self._pass_on("GET")

            def do_POST(self) -> None:
                self._pass_on("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_joiner_asks_again_for_a_certificate_the_coordinator_did_not_answer(coordinator: str):
    """The coordinator may die between its answer to /join and a joiner's certificate request (the
    chaos benchmark killed it there, and the trainer gave up). Within its --join-wait the joiner asks
    again, as it does for /join; with no wait it stops with a message that names the certificate."""
    front = DroppingFront(coordinator, drop=1)
    try:
        with pytest.raises(ConfigError, match="cannot reach .* for a certificate"):
            join_dht(front.url, "trainer", wait_s=0, client_mode=True)
        front.certificate_calls, front.drop = 0, 1
        run, _, dht, member = join_dht(front.url, "trainer", wait_s=30, client_mode=True)
        member.stop()
        dht.shutdown()
    finally:
        front.close()
    assert front.certificate_calls == 2
    assert run.run_id == load_config(TINY).run_id


def test_the_reader_reads_at_once_when_asked_and_no_more_often_than_its_gap(processes):
    """The coordinator's reader (an interval of 10 minutes here) reads the DHT when asked, as a peer
    that was just dialled back asks: the peer is listed without waiting for the interval. Asked again
    and again (a member asking for reachability in a loop), it reads once per MIN_GAP_S, no more."""
    dht = make_dht()
    holder = ViewHolder(empty_view(2))
    reader = SwarmReader(dht, "tiny", 2, holder, interval=600)
    reader.start()
    try:
        until(lambda: holder.reads == 1, "no first read")
        peer = PeerRecord(peer_id=dht.peer_id.to_base58(), stage=1, address="127.0.0.1:1", state="online")
        assert announce_peer(dht, "tiny", peer)
        time.sleep(0.5)
        assert holder.reads == 1 and not holder.get().stages[1], "read before it was asked to"
        holder.read_soon()
        until(lambda: any(p.peer_id == peer.peer_id for p in holder.get().stages[1]), "not read when asked")
        before, began = holder.reads, time.monotonic()
        while time.monotonic() - began < 2.0:
            holder.read_soon()
            time.sleep(0.001)
        assert 1 <= holder.reads - before <= 2.0 / SwarmReader.MIN_GAP_S + 1, holder.reads - before
    finally:
        reader.stop()
        shutdown_dht(dht)
