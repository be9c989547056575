"""The coordinator's history, events and metrics.

First the pure rules (which events a change of the swarm makes) and the SQLite store (it keeps
everything across a reopen); then a real swarm (coordinator, one peer per stage, a trainer) whose
coordinator must report the run's progress in /api/v1/state, /api/v1/history, /api/v1/events and
/metrics, refuse bad query parameters with 422, answer no request of a schema-driven fuzzer
with a server error ($SWARM_FUZZ_EXAMPLES per operation, default 25), and serve good requests after it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from prometheus_client.parser import text_string_to_metric_families
from schemathesis.checks import not_a_server_error

from benchmarks.fuzz import examples, rest_still_serves
from coordinator.events import Event, diff_events
from coordinator.history import SEEN_FORGET_S, SEEN_REFRESH_S, History, HistoryPoint, HistoryRecorder
from swarm.records import PeerRecord, SwarmView, TrainerRecord
from tests.conftest import CONFIGS, run_cli
from tests.harness import Swarm, swarm_fixture
from tests.processes import wait_for_state

# -- which events a change makes (pure) -------------------------------------------------------


def peer(pid: str, stage: int, state: str = "online", **kw) -> PeerRecord:
    return PeerRecord(peer_id=pid, stage=stage, address="127.0.0.1:1", public_name=f"name-{pid}", state=state, **kw)


def view(*peers: PeerRecord, trainers: list[TrainerRecord] = (), t: float = 100.0, stages: int = 2) -> SwarmView:
    return SwarmView(
        stages=[[p for p in peers if p.stage == k] for k in range(stages)], trainers=list(trainers), read_at=t
    )


def kinds(events: list[Event]) -> list[tuple[str, str | None, int | None]]:
    return [(e.kind, e.peer, e.stage) for e in events]


def test_a_peer_online_for_the_first_time_joins_once():
    joining, online = view(peer("a", 0, "joining")), view(peer("a", 0), t=101.0)
    events = diff_events(joining, online)
    assert kinds(events) == [("join", "name-a", 0)]
    assert events[0].t == 101.0 and "joined stage 0" in events[0].text
    assert kinds(diff_events(view(), online)) == kinds(events)  # online at its first sight
    assert diff_events(online, online) == []
    assert diff_events(joining, online, seen_online={"a"}) == []  # back online after a move or a restart


def test_leaving_is_a_leave_and_leaving_for_another_stage_is_a_move():
    online = view(peer("a", 0), peer("b", 1))
    after = view(peer("a", 0, "leaving"), peer("b", 1, "leaving", moving_to=0))
    events = diff_events(online, after)
    assert kinds(events) == [("leave", "name-a", 0), ("move", "name-b", 0)]
    assert "from stage 1 to stage 0" in events[1].text
    assert diff_events(after, after) == []


def test_a_peer_that_vanishes_without_leaving_is_a_failure():
    before = view(peer("dead", 0), peer("gone", 1, "leaving"), peer("mover", 0, "leaving", moving_to=1))
    after = view(peer("mover", 1, "joining"))
    events = diff_events(before, after)
    assert kinds(events) == [("failure", "name-dead", 0)]  # 'gone' and 'mover' said they were leaving
    assert "record expired: the peer died or lost its network" in events[0].text


def test_trainer_steps_collapse_into_one_event_and_failures_and_bans_are_counted():
    t0 = TrainerRecord(trainer_id="t", public_name="tr", steps=3, loss=2.5)
    one = TrainerRecord(trainer_id="t", public_name="tr", steps=4, loss=2.4)
    many = TrainerRecord(trainer_id="t", public_name="tr", steps=7, loss=2.1, val_loss=2.2, failures=2, bans=1)
    [step] = diff_events(view(trainers=[t0]), view(trainers=[one]))
    assert (step.kind, step.text) == ("step", "step 4: loss 2.4000 (tr)")
    events = diff_events(view(trainers=[one]), view(trainers=[many]))
    assert [e.kind for e in events] == ["failure", "ban", "step"]
    assert events[0].text == "trainer tr: 2 calls failed, retried on other peers"
    assert events[2].text == "steps 5–7: loss 2.1000, val_loss 2.2000 (tr)"
    assert diff_events(view(trainers=[many]), view(trainers=[many])) == []


# -- the SQLite store ---------------------------------------------------------------------------


def point(t: float, step: int, loss: float | None = 2.0) -> HistoryPoint:
    return HistoryPoint(t=t, step=step, loss=loss, val_loss=None, tokens_per_s=100.0, stage_throughput=[1.0, 2.0])


def test_history_survives_a_reopen_and_event_ids_go_on(tmp_path: Path):
    path = tmp_path / "history.sqlite"
    history = History(path)
    stored = history.add_events([Event(t=1.0, kind="join", peer="a", stage=0, text="a joined")] * 2)
    assert [e.id for e in stored] == [1, 2]
    history.add_point(point(1.0, 1))
    history.add_point(point(3.0, 2, None))
    history.add_seen_peers(["a"], 1.0)
    history.close()

    history = History(path)
    assert history.points() == [point(1.0, 1), point(3.0, 2, None)]
    assert history.points(since=2.0) == [point(3.0, 2, None)]
    assert history.last_point() == point(3.0, 2, None)
    assert history.seen_peers() == {"a": 1.0}
    [new] = history.add_events([Event(t=5.0, kind="leave", peer="a", stage=0, text="a left")])
    assert new.id == 3
    assert [e.id for e in history.events()] == [1, 2, 3]
    assert [e.id for e in history.events(limit=2)] == [2, 3]  # without `after`: the newest
    assert [e.id for e in history.events(after=1, limit=1)] == [2]
    history.close()


def test_a_long_history_is_thinned_out_evenly_keeping_the_newest(tmp_path: Path):
    history = History(tmp_path / "h.sqlite")
    for i in range(12):
        history.add_point(point(float(i), i))
    assert [p.step for p in history.points(max_points=5)] == [2, 5, 8, 11]
    assert [p.step for p in history.points(since=9.0, max_points=5)] == [9, 10, 11]


def test_not_a_database_is_refused_with_the_file_named(tmp_path: Path):
    path = tmp_path / "history.sqlite"
    path.write_text("not a database, " * 100)
    with pytest.raises(ValueError, match="cannot keep the history in .*history.sqlite"):
        History(path)


def test_the_recorder_stores_a_point_at_most_every_2_s_and_only_on_change(tmp_path: Path):
    history = History(tmp_path / "h.sqlite")
    record = HistoryRecorder(history)
    a0 = peer("a", 0, throughput=5.0)

    def trainer(steps: int) -> list[TrainerRecord]:
        return [TrainerRecord(trainer_id="t", steps=steps, loss=3.0 / steps, tokens_per_s=50.0)]

    record(view(t=0.0), view(a0, trainers=trainer(1), t=10.0))
    record(view(a0, trainers=trainer(1), t=10.0), view(a0, trainers=trainer(2), t=11.0))  # too soon
    record(view(a0, trainers=trainer(2), t=11.0), view(a0, trainers=trainer(2), t=14.0))
    record(view(a0, trainers=trainer(2), t=14.0), view(a0, trainers=trainer(2), t=17.0))  # nothing moved
    assert [(p.t, p.step, p.stage_throughput) for p in history.points()] == [
        (10.0, 1, [5.0, 0.0]),
        (14.0, 2, [5.0, 0.0]),
    ]
    assert [e.kind for e in history.events()] == ["join", "step", "step"]

    # A new recorder on the same store (a restarted coordinator) knows the peer and the last point.
    again = HistoryRecorder(history)
    again(view(t=20.0), view(a0, trainers=trainer(2), t=21.0))
    assert [e.kind for e in history.events(after=3)] == ["step"]  # a trainer first seen; the peer did not join anew
    assert len(history.points()) == 2


def test_a_peer_not_seen_online_for_an_hour_is_forgotten_and_joins_anew_when_it_comes_back(tmp_path: Path):
    history = History(tmp_path / "h.sqlite")
    record = HistoryRecorder(history)
    a0, b1 = peer("a", 0), peer("b", 1)
    record(view(t=0.0), view(a0, b1, t=10.0))
    record(view(a0, b1, t=10.0), view(b1, t=20.0))  # a vanishes ...
    record(view(b1, t=20.0), view(a0, b1, t=1810.0))  # ... and is back within the hour: no new join
    record(view(a0, b1, t=1810.0), view(b1, t=1820.0))
    later = 1810.0 + SEEN_FORGET_S + SEEN_REFRESH_S
    record(view(b1, t=1820.0), view(b1, t=later))
    assert set(record.seen) == {"b"} and set(history.seen_peers()) == {"b"}  # a forgotten, here and stored
    record(view(b1, t=later), view(a0, b1, t=later + 1))
    assert [e.peer for e in history.events() if e.kind == "join"] == ["name-a", "name-b", "name-a"]


def test_peers_that_come_and_go_for_good_are_not_remembered_past_the_hour(tmp_path: Path):
    history = History(tmp_path / "h.sqlite")
    record = HistoryRecorder(history)
    before, every = view(t=0.0), 30.0
    for i in range(500):  # a new peer every 30 s, each online for one read (each start is a new id)
        now = view(peer(f"p{i}", 0), t=(i + 1) * every)
        record(before, now)
        before = now
    bound = (SEEN_FORGET_S + SEEN_REFRESH_S) / every + 1
    assert len(record.seen) <= bound and len(history.seen_peers()) <= bound
    assert "p499" in record.seen and "p0" not in history.seen_peers()


def test_a_state_dir_that_cannot_be_created_is_refused(processes, tmp_path: Path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = run_cli("coordinator", "--config", str(CONFIGS / "tiny.toml"), "--state-dir", str(blocker / "state"))
    assert result.returncode == 2, result.stderr
    assert f"--state-dir {blocker / 'state'}: cannot keep the coordinator's state there" in result.stderr
    assert "Traceback" not in result.stderr


# -- a real swarm ----------------------------------------------------------------------------


@swarm_fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    """A coordinator, a0 on stage 0, a1 on stage 1, and a trainer that ran 8 steps."""
    swarm = Swarm(tmp_path_factory.mktemp("swarm"))
    try:
        swarm.add_peer("a0", 0)
        swarm.add_peer("a1", 1)
        swarm.wait_online(["a0", "a1"])
        swarm.train(steps=8)
        swarm.finish_training()
        yield swarm
    finally:
        swarm.close()


def get(swarm: Swarm, path: str, **params) -> httpx.Response:
    return httpx.get(f"{swarm.url}{path}", params=params, timeout=10)


def test_state_history_events_and_metrics_follow_the_run(trained: Swarm):
    state = wait_for_state(trained.url, lambda s: s["global_step"] >= 8 and s["loss"] is not None, timeout=30)
    final = trained.records()[-1]
    assert state["loss"] == pytest.approx(final["loss"]) and state["tokens_per_s"] > 0
    assert state["val_loss"] == pytest.approx(final["val_loss"])  # measured after the last step
    assert state["paused"] is False

    points = get(trained, "/api/v1/history").json()["points"]
    steps = [p["step"] for p in points]
    assert steps == sorted(steps) and steps[-1] > steps[0], points
    assert all(len(p["stage_throughput"]) == 2 for p in points)
    later = get(trained, "/api/v1/history", since=points[-1]["t"]).json()["points"]
    assert later and later[0] == points[-1]

    events = get(trained, "/api/v1/events").json()["events"]
    assert [e["id"] for e in events] == sorted(e["id"] for e in events)
    joins = {(e["peer"], e["stage"]) for e in events if e["kind"] == "join"}
    assert joins == {("a0", 0), ("a1", 1)}
    assert any(e["kind"] == "step" and "loss" in e["text"] for e in events)
    after_first = get(trained, "/api/v1/events", after=events[0]["id"], limit=1).json()["events"]
    assert [e["id"] for e in after_first] == [events[1]["id"]]

    response = get(trained, "/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    online = [s for s in families["swarm_peers"].samples if s.labels["state"] == "online"]
    assert sum(s.value for s in online) == 2 and {s.labels["stage"] for s in online} == {"0", "1"}
    assert families["swarm_global_step"].samples[0].value >= 8
    assert families["swarm_val_loss"].samples[0].value == pytest.approx(final["val_loss"])
    assert families["swarm_wire_bytes"].type == "counter" and families["swarm_wire_bytes"].samples[0].value > 0
    # One peer per stage: nobody to compare a peer's answers with, so no spot check (swarm/verify.py).
    assert all(t["spot_checks"] == t["spot_bans"] == 0 and t["spot_banned"] == {} for t in state["trainers"])
    for name in ["swarm_spot_checks", "swarm_spot_disagreements", "swarm_spot_bans"]:
        assert families[name].type == "counter" and families[name].samples[0].value == 0, name
    for name in ["swarm_stage_throughput_samples_per_second", "swarm_stage_bottleneck", "swarm_tokens_per_second"]:
        assert families[name].documentation
    assert "swarm_coordinator_view_age_seconds" in families and "swarm_loss" in families


@pytest.mark.parametrize(
    ("path", "params", "named"),
    [
        ("/api/v1/events", {"limit": 0}, "limit"),
        ("/api/v1/events", {"limit": 1001}, "limit"),
        ("/api/v1/events", {"limit": "many"}, "limit"),
        ("/api/v1/events", {"after": -1}, "after"),
        ("/api/v1/history", {"since": "yesterday"}, "since"),
        ("/api/v1/history", {"since": -5}, "since"),
    ],
)
def test_bad_query_parameters_get_422_naming_them(trained: Swarm, path: str, params: dict, named: str):
    response = get(trained, path, **params)
    assert response.status_code == 422
    assert [d["loc"] for d in response.json()["detail"]] == [["query", named]]
    assert get(trained, "/api/v1/events").status_code == 200  # still serving


@pytest.fixture(scope="module")
def live_schema(trained: Swarm):
    return schemathesis.openapi.from_url(f"{trained.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("live_schema")


@schema.parametrize()
@settings(max_examples=examples(25), deadline=None, suppress_health_check=list(HealthCheck))
def test_no_request_gets_a_server_error(case):
    if case.method == "GET":
        case.call_and_validate()  # and every response matches its schema
    else:
        # Started without --token, the operator's endpoints answer 403 to everyone: nothing changes
        # (by design 403, not the 401 a missing Authorization header would otherwise get).
        case.call_and_validate(checks=[not_a_server_error])


def test_after_the_fuzz_the_coordinator_still_serves_good_requests(trained: Swarm):
    assert trained.coordinator.popen.poll() is None, trained.coordinator.output()[-3000:]
    rest_still_serves(trained.url)
    state = wait_for_state(trained.url, lambda s: s["global_step"] >= 8)
    assert {p["public_name"] for st in state["stages"] for p in st["peers"]} == {"a0", "a1"}
