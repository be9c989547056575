"""Each volunteer's contribution (coordinator.contributions, /api/v1/peers/{peer}) and the stage
summaries and capacity figures of /api/v1/state.

The tally's rules on hand-made views (a move restarts a record's count, a restart is a new peer id
under the same name); then a real app (FastAPI's TestClient, no network) fed views through its
ViewHolder, as the coordinator's reader thread feeds it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from coordinator.app import JoinInfo, create_app, policy_throughput
from coordinator.contributions import Contributions, tally
from coordinator.history import History, HistoryRecorder
from coordinator.view import ViewHolder, empty_view
from swarm.config import load_config
from swarm.rebalance import best_assignment
from swarm.records import PeerRecord, SwarmView, TrainerRecord
from tests.conftest import CONFIGS


def peer(pid: str, stage: int, state: str = "online", name: str | None = None, **kw) -> PeerRecord:
    return PeerRecord(
        peer_id=pid, stage=stage, address="127.0.0.1:1", public_name=name or f"name-{pid}", state=state, **kw
    )


def view(*peers: PeerRecord, trainers: list[TrainerRecord] = (), t: float = 100.0, stages: int = 2) -> SwarmView:
    return SwarmView(
        stages=[[p for p in peers if p.stage == k] for k in range(stages)], trainers=list(trainers), read_at=t
    )


def test_a_tally_adds_up_the_stints_of_a_peer_that_moved():
    first = tally(None, [peer("a", 0, samples_served=50)], 1.0)
    assert (first.served, first.stage, first.first_seen) == (50, 0, 1.0)
    grown = tally(first, [peer("a", 0, samples_served=80)], 2.0)
    assert (grown.served_before, grown.served_now) == (0, 80)
    # Moving: 'leaving' on stage 0 and 'joining' on stage 1, both with the old count; then online from 0.
    moving = tally(grown, [peer("a", 0, "leaving", samples_served=90), peer("a", 1, "joining", samples_served=90)], 3.0)
    assert moving.served == 90
    moved = tally(moving, [peer("a", 1, samples_served=0)], 4.0)
    assert (moved.served_before, moved.served_now, moved.stage) == (90, 0, 1)
    later = tally(moved, [peer("a", 1, samples_served=25)], 5.0)
    assert (later.served, later.first_seen, later.last_seen) == (115, 1.0, 5.0)


@pytest.fixture
def app_parts(tmp_path: Path):
    run = load_config(CONFIGS / "tiny.toml")
    holder = ViewHolder(empty_view(run.stages.count))
    history = History(tmp_path / "history.sqlite")
    contributions = Contributions(tmp_path / "history.sqlite")
    holder.listen(HistoryRecorder(history))
    holder.listen(contributions)
    app = create_app(run, holder, JoinInfo(initial_peers=[]), history=history, contributions=contributions)
    yield holder, TestClient(app), tmp_path
    history.close()
    contributions.close()


def test_a_volunteer_s_page_adds_its_stints_and_restarts_and_its_share(app_parts):
    holder, client, tmp_path = app_parts
    holder.set(
        view(peer("a1", 0, name="alice", samples_served=100, throughput=5.0), peer("b", 1, samples_served=300), t=10)
    )
    holder.set(view(peer("a1", 0, name="alice", samples_served=140), peer("b", 1, samples_served=300), t=12))
    # alice moves to stage 1 (a new stint), then stops; she comes back as a new peer id
    holder.set(
        view(
            peer("a1", 0, "leaving", name="alice", samples_served=150, moving_to=1),
            peer("b", 1, samples_served=360),
            t=14,
        )
    )
    holder.set(view(peer("a1", 1, name="alice", samples_served=20), peer("b", 1, samples_served=360), t=16))
    holder.set(view(peer("b", 1, samples_served=400), t=30))
    trainer = TrainerRecord(trainer_id="t1", public_name="tr", spot_banned={"a2": 0}, served={"0": {"a2": 7}})
    holder.set(
        view(
            peer("a2", 0, name="alice", samples_served=30, started=1.0),
            peer("b", 1, samples_served=400),
            trainers=[trainer],
            t=40,
        )
    )

    body = client.get("/api/v1/peers/alice").json()
    assert body["name"] == "alice" and body["peer_ids"] == ["a1", "a2"]
    assert body["samples_served"] == 150 + 20 + 30
    assert body["swarm_samples_served"] == 200 + 400
    assert body["share"] == pytest.approx(200 / 600)
    assert body["online"] and body["stage"] == 0 and body["uptime_s"] > 0
    assert (body["first_seen"], body["last_seen"]) == (10, 40)
    assert body["banned_by"] == ["tr"] and body["receipts"] == 7
    assert [(e["kind"], e["stage"]) for e in body["stage_history"]] == [
        ("join", 0),
        ("move", 1),
        ("failure", 1),
        ("join", 0),
    ]
    assert [e["kind"] for e in body["bans"]] == ["ban"]
    speed = [(p["t"], p["peer_id"], p["stage"], p["samples"]) for p in body["speed"]]
    assert speed == [(10, "a1", 0, 100), (12, "a1", 0, 140), (14, "a1", 0, 150), (16, "a1", 1, 20), (40, "a2", 0, 30)]
    assert all(r["dht_addrs"] == [] for r in body["records"])

    one = client.get("/api/v1/peers/a1").json()  # by peer id: that id only
    assert one["peer_ids"] == ["a1"] and one["samples_served"] == 170 and not one["online"] and one["uptime_s"] is None

    # The figures are the stored ones: a new coordinator on the same file knows them.
    again = Contributions(tmp_path / "history.sqlite")
    assert sum(t.served for t in again.tallies_of(again.peer_ids("alice"))) == 200
    again.close()


def test_an_unknown_peer_is_a_404_naming_it_and_a_huge_one_a_422(app_parts):
    holder, client, _ = app_parts
    holder.set(view(peer("a", 0), t=10))
    response = client.get("/api/v1/peers/no%2Fbody<b>")
    assert response.status_code == 404
    assert "'no/body<b>'" in response.json()["detail"]
    assert client.get("/api/v1/peers/" + "x" * 300).status_code == 422
    schema = client.get("/openapi.json").json()
    assert "PeerContribution" in schema["components"]["schemas"]
    assert schema["paths"]["/api/v1/peers/{peer}"]["get"]["responses"]["200"]["content"]["application/json"][
        "schema"
    ] == {"$ref": "#/components/schemas/PeerContribution"}


def test_the_state_summarises_each_stage_and_what_balance_would_give(app_parts):
    holder, client, _ = app_parts
    # stage 0: 3 online (1, 2, 9 samples/s; queues 0, 1, 5), one joining; stage 1: one online (2), one leaving
    holder.set(
        view(
            peer("a", 0, throughput=1.0),
            peer("b", 0, throughput=2.0, queue=1),
            peer("c", 0, throughput=9.0, queue=5),
            peer("d", 0, "joining"),
            peer("e", 1, throughput=2.0, queue=1),
            peer("f", 1, "leaving", throughput=3.0, queue=9),
            t=10,
        )
    )
    state = client.get("/api/v1/state").json()
    zero, one = state["stages"]
    assert (zero["online"], zero["joining"], zero["leaving"]) == (3, 1, 0)
    assert (one["online"], one["joining"], one["leaving"]) == (1, 0, 1)
    assert (zero["throughput"], zero["median_throughput"], one["median_throughput"]) == (12.0, 2.0, 2.0)
    assert (zero["queue"], zero["queue_per_peer"], one["queue"], one["queue_per_peer"]) == (6, 2.0, 1, 1.0)
    assert (zero["bottleneck"], one["bottleneck"], zero["most_queue"], one["most_queue"]) == (False, True, True, False)
    assert state["peers_online"] == 4 and state["bottleneck_throughput"] == 2.0
    # The policy's best assignment swaps the 9 samples/s peer and e: stage totals 5 and 9.
    assert best_assignment([1.0, 2.0, 9.0, 2.0], [0, 0, 0, 1], 2) == [0, 0, 1, 0]
    assert state["policy_throughput"] == 5.0
    assert state["balanced_throughput"] == (12.0 + 2.0) / 2  # perfect balance: what the imbalance costs
    assert policy_throughput(empty_view(2)) == 0.0
