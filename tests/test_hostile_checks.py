"""Hostile insiders against the spot checks (swarm/verify.py, swarm/trainer/spotcheck.py): peers that
hold the run's join token and lie only where lying pays. Real processes: a coordinator, peers each on
a loopback address of its own (a machine of its own, unless two ids share one), a trainer.

- A liar that knows the run's config (its seed, the checked fraction) and how a trainer once picked
  its checks answers honestly until it is trusted, then corrupts only the calls it predicts are not
  checked. The checks are keyed by the trainer's secret, the ids it sees are opaque and inner-stage
  checks look like training calls: it lies where it is checked, and is banned.
- A liar that answers spot checks honestly (it can tell them apart: they keep no gradient) and
  corrupts the input gradients of its training answers, on the last stage (where its loss stays
  honest) or in an inner stage's Backward. The training call it lies in cannot be told from an
  unchecked one: it is outvoted and banned, each outvoted gradient is taken back and its microbatch
  redone on an honest peer, and no microbatch is applied twice.
- The same liar while the third machine of its stage is set aside by the trainer's router (its last
  call timed out): that machine is asked to settle the disagreement all the same, and the liar's
  answer never goes upstream (it once did: the check stayed undecided and its answer was used).
- Two Sybil ids on one machine tell the same lie. Votes count once per host: they can neither
  confirm each other's answers nor outvote an honest peer, and two honest machines outvote them.

For each: every step completes, the liars are banned where a majority of machines is honest, no
honest peer is ever banned, and the final validation
loss is at most 3% above the reference trainer's (`swarm train --local`, the same config and steps;
an honest swarm of tiny.toml ends 20 steps a few percent below it, its shards being leased in another
order, so the bound is one-sided: what an attack may not do is make the model worse). The runs are 12
steps long, the Sybils' beside two honest machines 20: their lies before the ban cost 5% of the loss
at step 12 (3.72 against 3.53), which the next steps win back.
"""

from __future__ import annotations

import functools
import json
import re
import tempfile
import time
from pathlib import Path

import pytest
import torch

from benchmarks.ledger import count
from coordinator.ca import RunCA
from peer.options import Faults
from peer.service import start_server
from peer.worker import StageWorker
from swarm.config import load_config
from swarm.records import make_dht, shutdown_dht
from swarm.trainer import Membership, SwarmCaller
from swarm.trainer.spotcheck import SpotCheckCaller, _answer
from swarm.verify import SpotChecks, agree
from swarm.wire import encode
from tests.conftest import run_cli
from tests.test_liveness import route
from tests.test_swarm import ACCUMULATION, TINY, Swarm, peer_record

STEPS = 12
SYBIL_STEPS = 20
LOSS_RTOL = 0.03  # the final loss within 3% of an honest run's


@functools.cache
def reference_loss(config_text: str, steps: int) -> float:
    """The final validation loss of the single-process reference trainer (`swarm train --local`) on a
    config after a number of steps, trained once for each for the whole test run."""
    with tempfile.TemporaryDirectory() as tmp:
        config, log = Path(tmp) / "run.toml", Path(tmp) / "reference.jsonl"
        config.write_text(config_text)
        result = run_cli("train", "--local", "--config", str(config), "--steps", str(steps), "--log-json", str(log))
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(log.read_text().splitlines()[-1])["val_loss"]


def checked_config(tmp: Path, fraction: float, stages: int = 2, extra: str = "") -> Path:
    """tiny.toml cut into `stages`, `fraction` of the training calls checked, and `extra` lines appended."""
    config = tmp / "run.toml"
    text = TINY.read_text()
    assert text.count("[stages]\ncount = 2\n") == 1
    text = text.replace("[stages]\ncount = 2\n", f"[stages]\ncount = {stages}\n")
    config.write_text(text + f"\n[verify]\nfraction = {fraction}\n" + extra)
    return config


def banned_peers(out: str) -> list[tuple[str, str]]:
    return re.findall(r"spot check: banned peer (\S+) of stage (\d+)", out)


def assert_trained_like_the_reference(swarm: Swarm, reference: Path = TINY, steps: int = STEPS) -> list[dict]:
    """Every step and microbatch done, and the final validation loss at most LOSS_RTOL above the
    reference trainer's on `reference` (by default tiny.toml: the stage count and the checked fraction
    that the tests here set do not enter a single process's training; 2 and 3 stages gave the same
    loss to the last digit)."""
    records = swarm.finish_training()
    accumulation = load_config(reference).training.accumulation
    assert len(records) == steps and records[-1]["microbatches"] == steps * accumulation, records[-1:]
    val, ref = records[-1]["val_loss"], reference_loss(reference.read_text(), steps)
    print(f"final validation loss {val:.4f}, reference {ref:.4f}")
    assert val <= ref * (1 + LOSS_RTOL), (val, ref, records[-1], what_happened(swarm))
    return records


def what_happened(swarm: Swarm) -> list[str]:
    """The trainer's events a failed run is read by: its spot checks' verdicts and its failed calls."""
    lines = swarm.trainer.output().replace("\r", "\n").splitlines()
    return [line.strip()[:200] for line in lines if "spot check" in line or "failed (" in line]


def test_a_liar_that_knows_the_seed_lies_where_it_is_checked_and_is_banned(processes, tmp_path):
    config = checked_config(tmp_path, 0.5)
    swarm = Swarm(tmp_path, config)
    try:
        # The honest peers of stage 0 are slower, so the router sends the liar most of the stage's calls.
        # At equal speeds, with stage 1's one peer the bottleneck, two idle honest peers took every call
        # of a CI run and the liar served none: it never lied, and nothing was there to catch.
        swarm.add_peer("honest0a", 0, "--delay-per-sample", "0.01")
        swarm.add_peer("honest0b", 0, "--delay-per-sample", "0.01")
        # Honest for its first 6 training forwards (a new peer's calls are all checked), then it lies
        # wherever it predicts no check.
        swarm.add_peer("liar", 0, "--corrupt-outputs", "0.5", "--lie-after", "6")
        swarm.add_peer("honest1", 1)
        state = swarm.wait_online(["honest0a", "honest0b", "liar", "honest1"])
        liar = peer_record(state, "liar")["peer_id"]
        swarm.train(STEPS, 4, 20)
        assert_trained_like_the_reference(swarm)
        out = swarm.trainer.output()
        assert banned_peers(out) == [(liar, "0")], out[-3000:]  # the liar, and nobody else
        liar_log = (tmp_path / "liar.log").read_text()
        assert "Traceback" not in liar_log
    finally:
        swarm.close()


@pytest.mark.parametrize("where", ["last stage", "inner backward"])
def test_a_liar_that_corrupts_only_its_training_gradients_is_banned_and_its_gradients_taken_back(
    processes, tmp_path, where
):
    stages = 2 if where == "last stage" else 3
    # Every call checked: each training answer the liar gives is compared (with half of them checked,
    # a CI run saw one of its lies in 12 steps). The first step's verdicts (first calls to each peer,
    # an arbiter's among them) held stage 0's step 6 s on a loaded CI machine: past the default norm
    # wait of 5 s, so the liar's stage clipped step 0 by its own norm instead of the whole model's, and
    # the run ended 3.2% above the reference's loss (twice, with the same 3.6417), for a reason that is
    # not the liar's. The norm wait here is long enough for the verdicts.
    config = checked_config(tmp_path, 1.0, stages, "\n[averaging]\nsync_timeout_s = 20.0\n")
    swarm = Swarm(tmp_path, config)
    try:
        names = []
        for k in range(stages):
            here = ["honest{k}a", "honest{k}b", "liar"] if k == 1 else [f"s{k}"]
            for name in here:
                name = name.format(k=k)
                # The honest peers of stage 1 are slower: the router sends the liar most of its calls.
                extra = ("--corrupt-grads", "1.0") if name == "liar" else ("--delay-per-sample", "0.01")
                swarm.add_peer(name, k, *(extra if k == 1 else ()))
                names.append(name)
        state = swarm.wait_online(names)
        liar = peer_record(state, "liar")["peer_id"]
        swarm.train(STEPS, 4, 20)
        records = assert_trained_like_the_reference(swarm)
        out = swarm.trainer.output()
        last = records[-1]
        # Each of the liar's outvoted training answers: its gradient taken back and its microbatch redone
        # on an honest peer, or, where the stage had stepped with it already, counted as kept and not
        # redone (it would count twice). Two strikes ban it. How many training answers it gives is the
        # router's to say (a replica whose step holds its work past the call's deadline gets few), so
        # the test asks that its lies were caught, and that it is banned once it lied twice.
        outvoted = last["outvoted_taken_back"] + last["outvoted_kept"]
        assert outvoted >= 1, last
        assert last["redone"] == last["outvoted_taken_back"], last
        banned = banned_peers(out)
        assert set(banned) <= {(liar, "1")}, out[-3000:]  # nobody else
        assert outvoted < 2 or banned == [(liar, "1")], out[-3000:]
        ledger = count(records, swarm.applied(), stages=stages)
        assert ledger.applied_twice == 0, ledger.summary()
    finally:
        swarm.close()


def test_a_liar_is_outvoted_by_a_third_machine_the_router_has_just_set_aside(processes, tmp_path):
    """In one process: three real stage-1 workers of tiny.toml (its last stage) on loopback addresses of
    their own, over mutual TLS, behind a trainer's spot-checking caller; one worker corrupts the input
    gradients of its training answers. Before each call honest `b` is set aside by the router (as after
    a timeout) and the liar is trusted more than honest `a`, so `a` answers the check and the liar the
    training call. Every answer the caller passes on is the honest one, the liar is banned at its
    second lie, and no check stays undecided."""
    run = load_config(TINY)
    ca = RunCA.load_or_create(tmp_path, run.run_id)
    dht = make_dht()
    ids, addresses, servers, workers = {}, {}, [], []
    for i, name in enumerate(["a", "b", "liar"]):
        faults = Faults(corrupt_grads=1.0) if name == "liar" else Faults()
        worker = StageWorker(run, 1, torch.device("cpu"), faults=faults)
        member = ca.member("peer")
        server, _, port = start_server(worker, f"127.0.0.{11 + i}", 0, member=member)
        workers.append(worker)
        servers.append(server)
        ids[name] = member.peer_id
        addresses[member.peer_id] = f"127.0.0.{11 + i}:{port}"
    spot = SpotChecks(run.stages.count, 1.0)
    members = Membership(run, dht, [], spot, refresh_s=3600.0)
    inner = SwarmCaller(run, members, lambda note: None, ca.member("trainer"), call_timeout=30.0)
    caller = SpotCheckCaller(inner, members, spot)
    honest = inner.client(ids["a"], addresses[ids["a"]])
    route(inner, 1, addresses)
    try:
        samples, gen = 2, torch.Generator().manual_seed(0)
        for i in range(4):
            with members.stage(1) as (router, _):
                for _ in range(6):  # set aside for a minute (exponential back-off)
                    router.failed(ids["b"], samples, time.monotonic())
            if ids["liar"] not in spot.banned:
                spot.stages[1].passed[ids["liar"]] = 10**6
            x = encode(torch.randn(samples, run.model.seq_len, run.model.d_model, generator=gen))
            targets = encode(torch.randint(0, run.model.vocab_size, (samples, run.model.seq_len), generator=gen))
            mb_id = f"microbatch-{i}"

            def send(client, train, check=False, x=x, targets=targets, mb_id=mb_id):
                scale = samples / run.training.global_batch
                return client.forward(1, x, mb_id, 0, targets=targets, train=train, loss_scale=scale, check=check)

            out, peer = caller.forward(1, samples, f"{i}.0", True, send, mb_id=mb_id)
            assert agree(_answer(out), _answer(send(honest, False, True)), caller._rtol()), (i, peer)
        counts = caller.counts()
        assert counts["spot_disagreements"] == 2 and counts["spot_unresolved"] == 0, counts
        assert spot.banned == {ids["liar"]: 1}, spot.banned
        assert counts["outvoted_taken_back"] == counts["redone"] == 2, counts
    finally:
        caller.close()
        members.close()
        for server in servers:
            server.stop(0)
        for worker in workers:
            worker.close()
        shutdown_dht(dht)


@pytest.mark.parametrize("honest", [1, 2])
def test_two_sybil_ids_on_one_machine_cannot_outvote_an_honest_peer(processes, tmp_path, honest):
    """Beside one honest machine the two Sybils are one voter against one: nobody can tell who is
    right, the disagreements are counted and nobody is banned (the Sybils used to outvote the honest
    peer and have it banned). Beside two honest machines they are outvoted and banned."""
    config = checked_config(tmp_path, 0.5)
    swarm = Swarm(tmp_path, config)
    try:
        swarm.add_peer("s0", 0)
        honest_names = [f"honest1{c}" for c in "ab"[:honest]]
        for name in honest_names:
            swarm.add_peer(name, 1)
        for name in ("sybil1", "sybil2"):  # one machine, two ids, the same lie
            swarm.add_peer(name, 1, "--host", "127.0.0.99", "--corrupt-outputs", "0.5")
        state = swarm.wait_online(["s0", *honest_names, "sybil1", "sybil2"])
        ids = {name: peer_record(state, name)["peer_id"] for name in (*honest_names, "sybil1", "sybil2")}
        steps = SYBIL_STEPS if honest == 2 else STEPS
        swarm.train(steps, 4, 20)
        if honest == 2:
            records = assert_trained_like_the_reference(swarm, TINY, steps)
        else:  # half the stage's answers are lies nobody can single out: no bound on the loss
            records = swarm.finish_training()
            assert len(records) == steps and records[-1]["microbatches"] == steps * ACCUMULATION
        out = swarm.trainer.output()
        banned = {peer for peer, _ in banned_peers(out)}
        assert not banned & {ids[n] for n in honest_names}, out[-3000:]  # no honest peer, ever
        if honest == 2:
            assert banned == {ids["sybil1"], ids["sybil2"]}, out[-3000:]
        else:
            assert not banned and records[-1]["spot_disagreements"] >= 2, records[-1]
    finally:
        swarm.close()
