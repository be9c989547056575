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
  unchecked one: it is outvoted and banned, its outvoted gradient is taken back and its microbatch
  redone on an honest peer: it applies no gradient, and every stage applies every microbatch once.
- The same liar while the third machine of its stage is set aside by the trainer's router (its last
  call timed out): that machine is asked to settle the disagreement all the same, and the liar's
  answer never goes upstream (it once did: the check stayed undecided and its answer was used).
- Two Sybil ids on one machine tell the same lie. Votes count once per host: they can neither
  confirm each other's answers nor outvote an honest peer, and two honest machines outvote them.

Each test asserts what the defence guarantees, read from what the processes write: the trainer's
events and per-step counters (`--log-json`), the peers' step logs (`--log-steps`). The loss is only
a sanity bound (finite, and lower at the last step than at the first): a final loss within 3% of the
reference trainer's, asserted here before, was off by 5% on a loaded machine with no attack at all.
"""

from __future__ import annotations

import math
import re
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
from tests.harness import ACCUMULATION, TINY, Swarm, peer_record
from tests.test_liveness import route

STEPS = 9  # the liar lies from its 7th forward and was banned by step 4, idle or loaded
SYBIL_STEPS = 6


def checked_config(tmp: Path, fraction: float, stages: int = 2, strikes: int = 2, micro_batch: int = 8) -> Path:
    """tiny.toml cut into `stages`, `fraction` of the training calls checked, a peer banned at its
    `strikes`-th outvoted answer, microbatches of `micro_batch` samples (of a global batch of 16)."""
    config = tmp / "run.toml"
    text = TINY.read_text()
    for part in ("[stages]\ncount = 2\n", "micro_batch = 8\n"):
        assert text.count(part) == 1, part
    text = text.replace("[stages]\ncount = 2\n", f"[stages]\ncount = {stages}\n")
    text = text.replace("micro_batch = 8\n", f"micro_batch = {micro_batch}\n")
    config.write_text(text + f"\n[verify]\nfraction = {fraction}\nstrikes = {strikes}\n")
    return config


def banned_peers(out: str) -> list[tuple[str, str]]:
    """(peer, stage) of each spot-check ban in the trainer's output."""
    return re.findall(r"spot check: banned peer (\S+) of stage (\d+)", out)


def outvoted(out: str) -> list[tuple[str, str, str]]:
    """(peer, stage, "training" or "check": the answer) of each outvote in the trainer's output."""
    return re.findall(r"spot check: peer (\S+) of stage (\d+) outvoted on its (?:redone )?(training|check) answer", out)


def undecided(out: str) -> list[tuple[str, str]]:
    """The two peers of each spot check that disagreed with no third machine to settle it."""
    return re.findall(r"spot check: stage \d+'s answers to \S+ from (\S+) and (\S+) disagree, and no third", out)


def assert_every_step_done(swarm: Swarm, steps: int = STEPS, accumulation: int = ACCUMULATION) -> list[dict]:
    """The trainer's records once it exited cleanly: every step (0 .. steps - 1, none skipped or
    repeated) and every microbatch done, and the model learning: every loss finite, the last step's
    below the first's (5.57 at the seeded init, about 4.8 after 6 steps of tiny.toml). A sanity bound
    only: what a defence guarantees is asserted from its own outputs."""
    records = swarm.finish_training()
    assert [r["step"] for r in records] == list(range(steps)), records[-1:]
    assert records[-1]["microbatches"] == steps * accumulation, records[-1]
    losses = [r["loss"] for r in records]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    return records


def what_happened(swarm: Swarm) -> list[str]:
    """The trainer's events a failed run is read by: its spot checks' verdicts and its failed calls."""
    lines = swarm.trainer.output().replace("\r", "\n").splitlines()
    return [line.strip()[:200] for line in lines if "spot check" in line or "failed (" in line]


def test_a_liar_that_knows_the_seed_lies_where_it_is_checked_and_is_banned(processes, tmp_path):
    """The liar answers its first training forwards honestly (a new peer's calls are all checked: it
    passes its first checks), then lies where it predicts no check; it is outvoted and, at its second
    strike, banned. With checks a peer could predict (a hash of the run's seed and plain microbatch
    names) it was never outvoted: this test fails so."""
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
        records = assert_every_step_done(swarm)
        out = swarm.trainer.output()
        happened = what_happened(swarm)
        votes = outvoted(out)
        # It lied where it was checked (as the training peer or as the checker: an inner stage's check
        # is a training forward too), and only it was outvoted: twice at least, its strikes.
        assert len(votes) >= 2 and {(peer, stage) for peer, stage, _ in votes} == {(liar, "0")}, happened
        assert banned_peers(out) == [(liar, "0")], happened  # the liar, and nobody else
        assert records[-1]["spot_bans"] == 1 and records[-1]["spot_disagreements"] >= 2, records[-1]
        liar_log = (tmp_path / "liar.log").read_text()
        assert "Traceback" not in liar_log
    finally:
        swarm.close()


@pytest.mark.parametrize("where", ["last stage", "inner backward"])
def test_a_liar_that_corrupts_only_its_training_gradients_is_banned_and_its_gradients_taken_back(
    processes, tmp_path, where
):
    """Every call is checked and one strike bans: the liar's first lie in a training answer is
    outvoted, it is banned at once, its gradient is taken back and its microbatch redone on an honest
    peer. Its own step log holds no microbatch: a gradient it was told to take back and kept would
    show there (and, redone, on an honest peer too: applied twice).

    One microbatch in flight, 8 a step: the lie (at the first or second training call the liar gets)
    is resolved before the next microbatch is sent, so its stage cannot have stepped with it yet. With
    4 in flight and 2 a step the stage often had (the other microbatch filled its batch): the gradient
    was then kept and counted so (`outvoted_kept`, docs/trust.md), and nothing was taken back."""
    stages = 2 if where == "last stage" else 3
    config = checked_config(tmp_path, 1.0, stages, strikes=1, micro_batch=2)
    steps = 2  # the lie comes in step 0; step 1 runs with the liar banned
    swarm = Swarm(tmp_path, config)
    try:
        names = []
        for k in range(stages):
            here = ["honest{k}a", "honest{k}b", "liar"] if k == 1 else [f"s{k}"]
            for name in here:
                name = name.format(k=k)
                # The honest peers of stage 1 are far slower: the router sends the liar most of its calls.
                # At 0.01 s a sample (0.02 s a call) a loaded machine's noise outweighed the difference:
                # the liar served no training call of the 4 steps, and nothing was there to catch.
                extra = ("--corrupt-grads", "1.0") if name == "liar" else ("--delay-per-sample", "0.1")
                swarm.add_peer(name, k, *(extra if k == 1 else ()))
                names.append(name)
        state = swarm.wait_online(names)
        liar = peer_record(state, "liar")["peer_id"]
        swarm.train(steps, 1, 20)
        records = assert_every_step_done(swarm, steps, 8)
        out = swarm.trainer.output()
        happened = what_happened(swarm)
        last = records[-1]
        # Its lie was caught, and only its training answers were outvoted.
        votes = outvoted(out)
        assert votes and set(votes) == {(liar, "1", "training")}, happened
        assert banned_peers(out) == [(liar, "1")], happened
        # Each outvoted training answer taken back and its microbatch redone on an honest peer.
        assert last["outvoted_taken_back"] == last["redone"] == len(votes), (last, happened)
        assert last["outvoted_kept"] == 0, (last, happened)
        # No check of the liar's stayed undecided. Two honest replicas may disagree for a step (an
        # all-reduce that lost parts under load, until the replica check reloads one: peer/replica_check.py)
        # with the liar banned and no third machine left: a CI run had 8 such checks, all after the ban.
        pairs = undecided(out)
        assert len(pairs) == last["spot_unresolved"] and not [p for p in pairs if liar in p], (last, happened)
        # The liar applied no gradient, and every stage applied every microbatch once.
        applied = [mb for step in swarm.applied() if step["peer"] == "liar" for mb in step["microbatches"]]
        assert not applied, (applied, happened)
        ledger = count(records, swarm.applied(), stages=stages)
        assert ledger.lost == 0 and ledger.applied_twice == 0, ledger.summary()
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
    right, each disagreement is counted as unsettled and nobody is banned (the Sybils used to outvote
    the honest peer and have it banned). Beside two honest machines they are outvoted and banned."""
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
        sybils = {ids["sybil1"], ids["sybil2"]}
        # Both Sybils lie in every answer, and a peer that has not passed its first checks has every call
        # of its stage checked: both were banned by step 2 of a 20-step run.
        # Beside one honest peer, what is asserted (disagreements left unresolved, no ban) comes from the
        # first steps, in which every call of a new peer is checked: 2 after step 0, 6 by step 2.
        steps = SYBIL_STEPS if honest == 2 else 3
        swarm.train(steps, 4, 20)
        records = assert_every_step_done(swarm, steps)
        out = swarm.trainer.output()
        happened = what_happened(swarm)
        last = records[-1]
        banned = [peer for peer, _ in banned_peers(out)]
        assert not {peer for peer, _, _ in outvoted(out)} - sybils, happened  # no honest peer outvoted, ever
        if honest == 2:
            assert sorted(banned) == sorted(sybils), happened
            # Each of their outvoted training answers taken back (and redone), or counted as kept.
            training = [v for v in outvoted(out) if v[2] == "training"]
            assert last["outvoted_taken_back"] + last["outvoted_kept"] == len(training), (last, happened)
        else:
            assert not banned and last["spot_unresolved"] == last["spot_disagreements"] >= 2, (last, happened)
    finally:
        swarm.close()
