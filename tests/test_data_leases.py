"""N trainers on one run read disjoint shards: the coordinator leases the run's shards
(coordinator/leases.py, /api/v1/data) and trainers read the shards they lease
(swarm/trainer/leases.py: CoordinatorShards). Real coordinators over HTTP, real trainers and peers.

The API: a lease wants the run's join token; bad bodies and unknown lease ids get a clear answer; a
shard goes to one trainer at a time, and to the next asker from its last reported offset when its
lease expires or is handed back; every shard done starts the next epoch; all of it outlives a
restart of the coordinator. The trainers: two trainers on one swarm train disjoint windows, and a
trainer killed mid-shard hands its shard over without a window trained twice.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from swarm.children import stop_all
from swarm.config import ConfigError, load_config
from swarm.data import TrainStream, epoch_order, shards
from swarm.trainer.leases import CoordinatorShards
from tests.conftest import run_cli
from tests.harness import swarm_fixture
from tests.processes import ROOT, Proc, child, free_port, start_coordinator, wait_for_state

TINY = ROOT / "configs" / "tiny.toml"
TOKEN = "leases-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SHARDS = 8
TTL_S = 2.0


def shard_files(folder: Path, count: int = SHARDS, paragraphs: int = 12) -> Path:
    """`count` small text files, each one shard (far below a shard's smallest size in bytes)."""
    folder.mkdir(parents=True, exist_ok=True)
    for k in range(count):
        text = "\n\n".join(
            f"Shard {k}, paragraph {p}: the quick brown fox jumps over the lazy dog, "
            f"and the swarm trains one model on many machines ({k * 1000 + p})."
            for p in range(paragraphs)
        )
        (folder / f"part-{k:02d}.txt").write_text(text + "\n")
    return folder


def files_config(tmp: Path, data: Path, **replace: str) -> Path:
    """configs/tiny.toml on the files under `data` (with `replace`: more text substitutions)."""
    text = TINY.read_text().replace('source = "embedded"', f'source = "files"\npath = "{data}"')
    for old, new in replace.items():
        text = text.replace(old, new)
    config = tmp / "run.toml"
    config.write_text(text)
    return config


def lease(url: str, trainer: str, headers: dict = AUTH) -> httpx.Response:
    return httpx.post(f"{url}/api/v1/data/lease", json={"trainer": trainer}, headers=headers, timeout=5)


def renew(url: str, lease_id: str, headers: dict = AUTH, **body) -> httpx.Response:
    return httpx.post(f"{url}/api/v1/data/lease/{lease_id}", json=body, headers=headers, timeout=5)


def granted(url: str, trainer: str) -> dict:
    response = lease(url, trainer)
    assert response.status_code == 200, response.text
    assert response.json()["lease"] is not None, response.json()
    return response.json()["lease"]


def data_state(url: str) -> dict:
    return httpx.get(f"{url}/api/v1/data", timeout=5).json()


@swarm_fixture(scope="module")
def guarded(tmp_path_factory) -> Iterator[str]:
    """A coordinator of 8 shard files with a join token and a short lease time to live."""
    tmp = tmp_path_factory.mktemp("leases")
    config = files_config(tmp, shard_files(tmp / "data"))
    proc, url = start_coordinator(config, tmp / "c.log", "--join-token", TOKEN, "--lease-ttl", str(TTL_S))
    yield url
    assert proc.stop() == 0, proc.output()[-3000:]


def test_a_lease_wants_the_join_token(guarded: str):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        refused = lease(guarded, "t1", headers)
        assert refused.status_code == 401 and "join token" in refused.json()["detail"], refused.text
        assert renew(guarded, "anything", headers, offset=1).status_code == 401
    # Anyone may see how far the epoch is, as anyone may read the swarm's state.
    assert data_state(guarded)["count"]["shards"] == SHARDS


def test_bad_bodies_are_refused_naming_the_field(guarded: str):
    url = f"{guarded}/api/v1/data/lease"
    for body, field in (
        ({}, "trainer"),
        ({"trainer": "a b"}, "trainer"),
        ({"trainer": "x" * 65}, "trainer"),
        ({"trainer": 7}, "trainer"),
        ({"trainer": "t", "shard": 3}, "shard"),
    ):
        refused = httpx.post(url, json=body, headers=AUTH, timeout=5)
        assert refused.status_code == 422, (body, refused.text)
        assert field in json.dumps(refused.json()["detail"]), (body, refused.text)
    assert httpx.post(url, content=b"not json", headers=AUTH, timeout=5).status_code == 422
    mine = granted(guarded, "bodies")
    for body, field in (
        ({}, "offset"),
        ({"offset": -1}, "offset"),
        ({"offset": "3"}, "offset"),
        ({"offset": 2**63}, "offset"),
        ({"offset": 1, "done": "yes"}, "done"),
        ({"offset": 1, "extra": 1}, "extra"),
    ):
        refused = renew(guarded, mine["lease_id"], **body)
        assert refused.status_code == 422, (body, refused.text)
        assert field in json.dumps(refused.json()["detail"]), (body, refused.text)
    # A lease's offset never goes back: the windows before it are trained.
    assert renew(guarded, mine["lease_id"], offset=mine["offset"] + 4).status_code == 200
    back = renew(guarded, mine["lease_id"], offset=mine["offset"] + 1)
    assert back.status_code == 409 and "never goes back" in back.json()["detail"], back.text
    assert renew(guarded, mine["lease_id"], offset=mine["offset"] + 4, release=True).status_code == 200


def test_an_unknown_lease_id_is_not_found_with_a_message(guarded: str):
    missing = renew(guarded, "no-such-lease", offset=0)
    assert missing.status_code == 404 and "no lease 'no-such-lease'" in missing.json()["detail"], missing.text


def test_shards_go_to_one_trainer_at_a_time_and_expire_to_the_next_at_the_reported_offset(processes, tmp_path: Path):
    config = files_config(tmp_path, shard_files(tmp_path / "data"))
    # Long enough for the requests between two renewals on a busy machine: at 5 s, the six requests after
    # the last keep-alive took longer beside two busy loops, and the others' leases had expired (404).
    ttl = 10.0
    proc, url = start_coordinator(config, tmp_path / "c.log", "--lease-ttl", str(ttl))  # an open run
    seed = load_config(config).training.seed
    try:
        leases = [granted(url, f"t{k}") for k in range(SHARDS)]
        assert sorted(x["shard"] for x in leases) == list(range(SHARDS))
        assert {x["epoch"] for x in leases} == {0} and {x["offset"] for x in leases} == {0}
        assert all(x["name"].endswith(f"part-{x['shard']:02d}.txt") for x in leases)
        assert [x["shard"] for x in leases] == epoch_order(SHARDS, seed, 0)
        assert data_state(url)["count"] == {
            **{"epoch": 0, "shards": SHARDS, "done": 0, "leased": SHARDS, "free": 0, "ahead": 0}
        }

        # Every shard of the epoch leased: the next asker reads on into the next epoch, in its order.
        early = granted(url, "early")
        assert (early["epoch"], early["shard"], early["offset"]) == (1, epoch_order(SHARDS, seed, 1)[0], 0)
        state = data_state(url)
        assert state["count"] == {"epoch": 0, "shards": SHARDS, "done": 0, "leased": SHARDS, "free": 0, "ahead": 1}
        assert [(s["shard"], s["trainer"]) for s in state["ahead"]] == [(early["shard"], "early")]
        assert {s["trainer"] for s in state["shards"]} == {f"t{k}" for k in range(SHARDS)}

        # Shard of leases[0]: 5 windows trained, then its trainer is silent; the others keep renewing.
        # Expired, it goes out again before any more of the next epoch's shards.
        first, rest = leases[0], [*leases[1:], early]
        assert renew(url, first["lease_id"], offset=5).json()["expires_in_s"] == pytest.approx(ttl, abs=0.5)
        deadline = time.monotonic() + ttl + 1
        while time.monotonic() < deadline:
            for x in rest:
                assert renew(url, x["lease_id"], offset=0).status_code == 200
            time.sleep(ttl / 4)
        taken = granted(url, "next")
        assert (taken["shard"], taken["offset"], taken["epoch"]) == (first["shard"], 5, 0)
        gone = renew(url, first["lease_id"], offset=6)
        assert gone.status_code == 404 and "expired" in gone.json()["detail"], gone.text
        listed = {s["shard"]: s for s in data_state(url)["shards"]}
        assert listed[first["shard"]]["trainer"] == "next" and listed[first["shard"]]["offset"] == 5

        # Handed back (a trainer that leaves): the next asker gets it at once, from the offset.
        assert renew(url, taken["lease_id"], offset=9, release=True).status_code == 200
        again = granted(url, "after")
        assert (again["shard"], again["offset"]) == (first["shard"], 9)

        # Every shard done: the next epoch starts, its shards from offset 0 but for the one read ahead.
        assert renew(url, early["lease_id"], offset=3).status_code == 200
        for x in [again, *leases[1:]]:
            assert renew(url, x["lease_id"], offset=20, done=True).status_code == 200
        state = data_state(url)
        assert state["count"] == {"epoch": 1, "shards": SHARDS, "done": 0, "leased": 1, "free": SHARDS - 1, "ahead": 0}
        assert [(s["shard"], s["offset"], s["trainer"]) for s in state["shards"] if s["trainer"] or s["offset"]] == [
            (early["shard"], 3, "early")
        ]
        assert renew(url, early["lease_id"], offset=4).json()["epoch"] == 1  # its lease lives on
        epoch1 = granted(url, "t0")
        assert (epoch1["epoch"], epoch1["shard"], epoch1["offset"]) == (1, epoch_order(SHARDS, seed, 1)[1], 0)

        # Only one epoch ahead: once both epochs' shards are leased, an asker gets none.
        more = [granted(url, f"u{k}") for k in range(2 * SHARDS - 2)]
        assert [x["epoch"] for x in more] == [1] * (SHARDS - 2) + [2] * SHARDS
        none = lease(url, "late").json()
        assert none["lease"] is None and 0 < none["retry_s"] <= ttl, none
    finally:
        stop_all([proc])


def test_a_restarted_coordinator_keeps_the_epoch_and_its_leases(processes, tmp_path: Path):
    config = files_config(tmp_path, shard_files(tmp_path / "data"))
    args = ["--state-dir", str(tmp_path / "state"), "--dht-port", str(free_port()), "--lease-ttl", str(TTL_S)]
    proc, url = start_coordinator(config, tmp_path / "c0.log", *args)
    procs: list[Proc] = [proc]
    try:
        a, b = granted(url, "a"), granted(url, "b")
        assert renew(url, a["lease_id"], offset=7, done=True).status_code == 200
        assert renew(url, b["lease_id"], offset=3).status_code == 200
        assert proc.stop() == 0, proc.output()[-3000:]
        proc, url = start_coordinator(config, tmp_path / "c1.log", *args, port=int(url.rsplit(":", 1)[1]))
        procs.append(proc)
        # b's lease lives on (its holder could not renew while the coordinator was down) with its offset.
        assert renew(url, b["lease_id"], offset=4).json()["offset"] == 4
        shards = {s["shard"]: s for s in data_state(url)["shards"]}
        assert shards[a["shard"]]["done"] and shards[b["shard"]] == dict(shards[b["shard"]], offset=4, trainer="b")
        assert granted(url, "c")["shard"] not in (a["shard"], b["shard"])
        assert data_state(url)["count"]["epoch"] == 0
    finally:
        stop_all(procs)


def test_a_trainer_holding_one_shard_in_two_epochs_reports_each_on_its_own_lease(processes, tmp_path: Path):
    """A run of one shard: a trainer reads its last windows of epoch 0 while it reads the first of
    epoch 1, on two leases of the same shard. Its progress on one must not land on the other."""
    config = files_config(tmp_path, shard_files(tmp_path / "data", count=1))
    proc, url = start_coordinator(config, tmp_path / "c.log", "--lease-ttl", "30")
    source = CoordinatorShards(url, shards(load_config(config).data), "t")
    try:
        (shard, start, epoch), ahead = source.next_shard(), source.next_shard()
        assert (shard.index, start, epoch) == (0, 0, 0) and ahead == (shard, 0, 1)
        source.progress(shard, 0, 4)
        source.progress(shard, 1, 2)
        assert [(s["offset"], s["trainer"]) for s in data_state(url)["shards"]] == [(4, "t")]
        assert [(s["offset"], s["trainer"]) for s in data_state(url)["ahead"]] == [(2, "t")]
        source.done(shard, 0)
        state = data_state(url)  # epoch 0 ended; the lease of epoch 1 goes on from its offset
        assert state["count"]["epoch"] == 1 and state["ahead"] == [], state
        assert [(s["offset"], s["done"], s["trainer"]) for s in state["shards"]] == [(2, False, "t")]
    finally:
        source.close()
        stop_all([proc])


def test_a_damaged_leases_file_stops_the_coordinator_with_a_clear_error(processes, tmp_path: Path):
    config = files_config(tmp_path, shard_files(tmp_path / "data"))
    state = tmp_path / "state"
    state.mkdir()
    (state / "leases.json").write_text('{"names": [], "epoch": -1, "shards": []}')
    started = run_cli("coordinator", "--config", str(config), "--port", "0", "--state-dir", str(state), timeout=60)
    assert started.returncode != 0
    assert "leases.json: epoch: Input should be greater than or equal to 0" in started.stderr, started.stderr
    assert "remove it to start the data from its first epoch" in started.stderr


# -- trainers ------------------------------------------------------------------------------------

# Shards larger than a trainer's shuffle buffer (swarm.data.SHUFFLE_WINDOWS windows of 129 bytes):
# a trainer then holds one or two shards at a time, not the whole epoch.
BIG = 220


def start_trainer(url: str, tmp: Path, name: str, steps: int) -> Proc:
    args = ["train", "--coordinator", url, "--steps", str(steps), "--inflight", "2", "--allow-config-files"]
    args += ["--log-json", str(tmp / f"{name}.jsonl"), "--log-windows", str(tmp / f"{name}.windows")]
    return child(args, tmp / f"{name}.log")


def windows_of(tmp: Path, name: str) -> list[tuple[int, int]]:
    """The (shard, window) ids the trainer `name` logged as trained, in order."""
    path = tmp / f"{name}.windows"
    lines = path.read_text().splitlines() if path.exists() else []
    out = []
    for line in lines:
        with contextlib.suppress(json.JSONDecodeError):  # the last line of a killed trainer
            out += [tuple(w) for w in json.loads(line)["ids"]]
    return out


def swarm_of(tmp: Path, *coordinator_args: str, paragraphs: int = BIG) -> tuple[list[Proc], str]:
    """A coordinator of 8 shard files (large by default) and one peer per stage, online."""
    data = shard_files(tmp / "data", paragraphs=paragraphs)
    config = files_config(tmp, data, **{"eval_every = 50": "eval_every = 0"})
    coordinator, url = start_coordinator(config, tmp / "coordinator.log", *coordinator_args)
    procs = [coordinator]
    for k in range(2):
        args = ["peer", "--coordinator", url, "--stage", str(k), "--public-name", f"p{k}", "--threads", "1"]
        procs.append(child([*args, "--no-rebalance", "--checkpoint-dir", "none"], tmp / f"p{k}.log"))

    def online(state: dict) -> bool:
        return {"p0", "p1"} <= {p["public_name"] for s in state["stages"] for p in s["peers"] if p["state"] == "online"}

    wait_for_state(url, online, timeout=120)
    return procs, url


def test_one_trainer_on_a_swarm_trains_the_windows_a_trainer_alone_would_in_its_order(processes, tmp_path: Path):
    """The coordinator leases each epoch's shards in the order a trainer reading alone takes them
    (swarm.data.epoch_order, from the run's seed): one trainer on a swarm trains the very windows, in
    the very order, of `swarm train --local`, so that the two runs' losses compare step by step. Across
    an epoch's end too: an epoch of about 340 windows, above the trainer's shuffle buffer of 256, so
    that it reads the next epoch's first shard while the last of this one are still in its buffer (a
    coordinator that leased none of the next epoch until this one's were trained left the trainer
    drawing from a draining buffer)."""
    steps = 8
    procs, url = swarm_of(tmp_path, paragraphs=40)
    try:
        trainer = start_trainer(url, tmp_path, "a", steps=steps)
        procs.append(trainer)
        assert trainer.popen.wait(300) == 0, trainer.output()[-3000:]
        run = load_config(tmp_path / "run.toml")
        alone = TrainStream.local(run.data, run.model.seq_len, run.training.seed)
        t = run.training
        expected = [w for _ in range(steps * t.accumulation) for w in alone.next_microbatch(t.micro_batch).ids]
        assert alone.source.epoch == 1, "the trainer alone never read into the next epoch"
        assert windows_of(tmp_path, "a") == expected
        assert {s for s, _ in expected} != {0}, "the epoch's first shards are the first in index order too"
    finally:
        stop_all(procs)


def test_two_trainers_on_one_run_train_disjoint_windows(processes, tmp_path: Path):
    each = 4  # steps of each trainer: each leases 1 to 2 shards whatever the count
    procs, url = swarm_of(tmp_path)
    try:
        trainers = [start_trainer(url, tmp_path, name, steps=each) for name in ("a", "b")]
        procs += trainers
        for t in trainers:
            assert t.popen.wait(300) == 0, t.output()[-3000:]
        a, b = windows_of(tmp_path, "a"), windows_of(tmp_path, "b")
        assert len(a) == len(b) == each * 16, (len(a), len(b))  # tiny.toml: global_batch 16
        assert len(set(a)) == len(a) and len(set(b)) == len(b)
        assert not set(a) & set(b), sorted(set(a) & set(b))[:10]
        shards_a, shards_b = {s for s, _ in a}, {s for s, _ in b}
        assert not shards_a & shards_b, (shards_a, shards_b)
        print(f"trainer a read shards {sorted(shards_a)}, trainer b {sorted(shards_b)}")
        # Each trainer names the step the stages reached after each of its own: the steps rise. How far
        # they rise depends on how the two overlapped: a stage steps once it holds a global batch from
        # either trainer, so two trainers in lockstep complete a step together (both name the same steps,
        # one for each of their own), and two that drift apart name steps past their own count.
        steps = {
            n: [json.loads(line)["step"] for line in (tmp_path / f"{n}.jsonl").read_text().splitlines()] for n in "ab"
        }
        for name, s in steps.items():
            assert len(s) == each and all(x < y for x, y in zip(s, s[1:], strict=False)), (name, s)
        print(f"steps of trainer a: {steps['a']}, of trainer b: {steps['b']}")
    finally:
        stop_all(procs)


def test_a_killed_trainers_shard_goes_to_the_next_from_its_reported_offset(processes, tmp_path: Path):
    procs, url = swarm_of(tmp_path, "--lease-ttl", "3")
    try:
        a = start_trainer(url, tmp_path, "a", steps=200)
        procs.append(a)
        deadline = time.monotonic() + 180
        while len(windows_of(tmp_path, "a")) < 6 * 16:
            assert a.popen.poll() is None, a.output()[-3000:]
            assert time.monotonic() < deadline, "trainer a trained too few windows"
            time.sleep(0.2)
        held = {s["shard"]: s["offset"] for s in data_state(url)["shards"] if s["trainer"]}
        assert held, data_state(url)
        os.killpg(a.popen.pid, signal.SIGKILL)
        a.popen.wait(10)

        # Its leases expire (3 s); the shards keep the offsets it reported last.
        deadline = time.monotonic() + 15
        while (state := data_state(url))["count"]["leased"]:
            assert time.monotonic() < deadline, state
            time.sleep(0.3)
        reported = {s["shard"]: s["offset"] for s in state["shards"] if not s["done"] and s["offset"]}
        assert reported, state
        first = min(reported)

        b = start_trainer(url, tmp_path, "b", steps=6)
        procs.append(b)
        assert b.popen.wait(300) == 0, b.output()[-3000:]
        mine, theirs = windows_of(tmp_path, "b"), windows_of(tmp_path, "a")
        taken = [w for s, w in mine if s == first]
        assert taken and min(taken) >= reported[first], (reported[first], sorted(taken)[:5])
        # Every window below the offset the killed trainer reported is trained once only.
        below = [w for s, w in theirs if s == first and w < reported[first]]
        assert sorted(below) == list(range(reported[first]))
        assert not {(first, w) for w in taken} & {(first, w) for w in below}
        # The windows trained by both: only those the killed trainer trained above the offset it
        # reported (its shuffle buffer trains a shard's windows out of order; the offset is the
        # first window not yet trained).
        twice = set(theirs) & set(mine)
        assert all(s in reported and w >= reported[s] for s, w in twice), sorted(twice)[:10]
        print(f"reported offset {reported[first]} of shard {first}; trained by both: {len(twice)} windows above it")
    finally:
        stop_all(procs)


def test_a_trainer_asks_a_restarting_coordinator_for_the_shards_again(processes, tmp_path):
    """A trainer fetched the run's config, then the coordinator went down (restarting, as the chaos
    run does it): the trainer's first data request keeps asking until the coordinator is back,
    instead of giving up at once; one that stays away is an error naming the flag and the URL."""

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(ConfigError, match=f"--coordinator: cannot reach {url} for the data's shards"):
        CoordinatorShards.offered(url, reach_s=1.0)

    coordinator = None

    def start_later() -> None:
        nonlocal coordinator
        time.sleep(2.0)
        coordinator, _ = start_coordinator(TINY, tmp_path / "coordinator.log", port=port)

    starter = threading.Thread(target=start_later)
    starter.start()
    try:
        assert CoordinatorShards.offered(url, reach_s=60.0) is True
    finally:
        starter.join()
        if coordinator is not None:
            stop_all([coordinator])
