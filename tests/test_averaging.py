"""Per-stage gradient averaging: what a peer hands to the average (pure, real tensors); then with
real processes: replicas stay equal, late joiners take the stage's state, and an unequal swarm
rebalances close to the best assignment."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import hivemind
import pytest
import torch
from hivemind.averaging.control import AveragingStage
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from pydantic import ValidationError

from benchmarks.rebalance import best_min_total, stage_totals
from peer.averaging import SwarmUpdater
from peer.contribution import clip_contribution, drop_grads, grads_finite
from peer.hivemind_compat import SpacedLeaders, TrackerView, step_bits, tracked_partners
from peer.norm_exchange import NormExchange
from peer.options import Faults
from peer.replica_check import ReplicaCheck, weights_digest
from peer.requests import ForwardWork
from peer.rounds import live_partners
from peer.stepper import Stepper
from peer.worker import StageWorker
from swarm import norms
from swarm.config import RunConfig, load_config
from swarm.data import TrainStream
from swarm.model import Stage, build_stages, lm_loss
from swarm.records import (
    TTL_S,
    NormShare,
    PeerRecord,
    WeightsDigest,
    announce_peer,
    averaging_prefix,
    digest_key,
    make_dht,
    norm_key,
    owned_subkey,
    publish_digest,
    publish_norm_share,
    shutdown_dht,
    signer_peer_id,
    stage_norms,
    state_holders_key,
    visible_maddrs,
)
from swarm.rpc import swarm_pb2 as pb
from swarm.wire import decode, encode
from tests.harness import TINY, Swarm, online_names, peer_record, state, swarm_fixture
from tests.processes import ROOT, member_client, wait_for_state

FAST_AVERAGING = "\n[averaging]\nmatchmaking_time_s = 0.5\nrequest_timeout_s = 0.3\n"
RUN = load_config(TINY)


# -- what a peer hands to the average (no network) --------------------------------------------


def flat_grad(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in module.parameters()])


def set_grad(module: torch.nn.Module, flat: torch.Tensor) -> None:
    for p, g in zip(module.parameters(), flat.split([p.numel() for p in module.parameters()]), strict=True):
        p.grad = g.view_as(p).clone()


def honest_gradients(peers: int) -> list[torch.Tensor]:
    """Stage 1's gradient of the tiny model on `peers` different micro-batches of real text."""
    first, last = build_stages(RUN)
    data = TrainStream.local(RUN.data, RUN.model.seq_len, RUN.training.seed)
    grads = []
    for _ in range(peers):
        batch = data.next_microbatch(RUN.training.micro_batch)
        last.zero_grad(set_to_none=True)
        lm_loss(last(first(batch.inputs).detach()), batch.targets).backward()
        grads.append(flat_grad(last))
    return grads


def test_a_contribution_longer_than_the_bound_is_clipped_to_it_and_a_shorter_one_is_left_alone():
    module = Stage(RUN, 1)
    g = torch.randn(sum(p.numel() for p in module.parameters()), generator=torch.Generator().manual_seed(0))
    set_grad(module, g * (25.0 / g.norm()))
    assert clip_contribution(module, 10.0) == pytest.approx(0.4, rel=1e-5)
    clipped = flat_grad(module)
    assert clipped.norm() == pytest.approx(10.0, rel=1e-5)
    assert torch.allclose(clipped, g * (10.0 / g.norm()), rtol=1e-4, atol=1e-7)  # same direction
    set_grad(module, g * (3.0 / g.norm()))
    assert clip_contribution(module, 10.0) == 1.0 and torch.equal(flat_grad(module), g * (3.0 / g.norm()))
    set_grad(module, g * 1e6)
    assert clip_contribution(module, 0.0) == 1.0 and torch.equal(flat_grad(module), g * 1e6)  # 0: no bound


def test_one_peers_huge_gradient_does_not_take_over_the_stages_average():
    """Four honest peers and one whose finite gradient is 10^4 times too long, averaged with equal
    weights: unclipped, the average points where the bad one does; clipped at the run's bound
    (averaging.contribution_clip x training.grad_clip), it stays with the honest mean, and the
    honest contributions themselves are not clipped."""
    bound = RUN.averaging.contribution_clip * RUN.training.grad_clip
    honest = honest_gradients(4)
    bad = torch.randn(honest[0].numel(), generator=torch.Generator().manual_seed(1)) * honest[0].norm() * 1e4
    honest_mean = torch.stack(honest).mean(0)
    module = Stage(RUN, 1)

    def contribution(g: torch.Tensor) -> tuple[torch.Tensor, float]:
        set_grad(module, g)
        factor = clip_contribution(module, bound)
        return flat_grad(module), factor

    clipped = [contribution(g) for g in [*honest, bad]]
    assert [f for _, f in clipped[:4]] == [1.0] * 4 and clipped[4][1] < 1e-3
    cos = torch.nn.functional.cosine_similarity
    unguarded = torch.stack([*honest, bad]).mean(0)
    guarded = torch.stack([g for g, _ in clipped]).mean(0)
    assert cos(unguarded, honest_mean, dim=0) < 0.05
    assert cos(guarded, honest_mean, dim=0) > 0.8
    assert guarded.norm() <= bound


def test_a_non_finite_gradient_is_left_out_of_the_average():
    module = Stage(RUN, 1)
    for bad in (float("nan"), float("inf"), 1e30):  # 1e30 is finite, but its norm is not
        set_grad(module, torch.ones(sum(p.numel() for p in module.parameters())))
        assert grads_finite(module)
        next(module.parameters()).grad.view(-1)[7] = bad
        assert not grads_finite(module)
        drop_grads(module)
        assert grads_finite(module) and not flat_grad(module).any()


def config_with(tmp_path, extra: str):
    path = tmp_path / "run.toml"
    path.write_text(TINY.read_text() + extra)
    return path, load_config(path)


def parameters(url: str, run, record: dict) -> tuple[int, dict[str, torch.Tensor]]:
    """The weights and step of the peer `record` of the run at `url`."""
    client = member_client(url, run, record)
    try:
        response = client.parameters(record["stage"])
    finally:
        client.close()
    return response.optimizer_steps, {p.name: decode(p.tensor) for p in response.parameters}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


@swarm_fixture(params=["int8", "diloco int4"])
def averaging_swarm(tmp_path, request):
    """A swarm whose stages average with `[averaging] compression` = the param (with "diloco": in
    DiLoCo phases of 3 steps, so that the test's 6 steps end with an outer step). A lossy codec
    for each mode, DiLoCo's the one the README recommends over home uplinks: that every codec leaves
    the replicas with the same bits is tested round by round on real averagers
    (tests/test_allreduce.py, tests/test_powersgd.py), at a fraction of a swarm's cost."""
    swarm = averaging_swarm_of(tmp_path, request.param)
    yield swarm
    swarm.close()


def averaging_swarm_of(tmp_path, spec: str) -> Swarm:
    """A swarm (no peers yet) for `spec`: "[diloco ]COMPRESSION"; its run config as `swarm.run`."""
    *mode, compression = spec.split()
    extra = f'compression = "{compression}"\n' + ('mode = "diloco"\ninner_steps = 3\n' if mode else "")
    path, run = config_with(tmp_path, FAST_AVERAGING + extra)
    swarm = Swarm(tmp_path, path)
    swarm.run = run
    return swarm


def test_a_stages_norm_is_the_median_of_its_members_shares_and_bad_values_are_dropped():
    """The pure part of reading the norm shares: a share that is not a finite non-negative number at
    a sane step does not parse (the reader skips it); a stage's norm is the median of its members'
    shares at the step asked, so one lying member of three does not set it, and a share from outside
    the stage, or of another step, is not counted."""
    for bad in ({"squared": -1.0}, {"squared": float("nan")}, {"squared": float("inf")}, {"squared": "-inf"}):
        with pytest.raises(ValidationError):
            NormShare.model_validate({"peer_id": "p", "stage": 0, "step": 3, **bad})
    for step in (-1, 2**40):
        with pytest.raises(ValidationError):
            NormShare(peer_id="p", stage=0, step=step, squared=1.0)
    with pytest.raises(ValidationError):
        WeightsDigest(peer_id="p", stage=0, step=0, digest="not hex")

    def share(peer: str, stage: int, squared: float, step: int = 3) -> NormShare:
        return NormShare(peer_id=peer, stage=stage, step=step, squared=squared)

    shares = [
        share("a0", 0, 4.0),
        share("b0", 0, 4.0),
        share("c0", 0, 1e30),  # a lying member: outvoted
        share("a1", 1, 9.0),
        share("b1", 1, 25.0),  # two disagreeing members: their median (the mean of two)
        share("x", 1, 1e30),  # not a member of stage 1
        share("a0", 1, 1e30),  # a member of stage 0 speaking for stage 1
        share("a1", 1, 1e30, step=2),  # another step
        share("x", 2, 1.0),  # a stage nobody serves
    ]
    members = {0: {"a0", "b0", "c0"}, 1: {"a1", "b1"}, 2: set()}
    assert stage_norms(shares, 3, members) == {0: 4.0, 1: 17.0}
    assert stage_norms(shares, 2, members) == {1: 1e30}
    assert stage_norms(shares, 3, {}) == {}


def stored(store, what: str, timeout: float = 60) -> None:
    """Call `store` (a DHT store that says whether it was confirmed) until the DHT confirms it. On a
    loaded machine a store may go unconfirmed (a node answering late: a CI run's did); what these tests
    look at is what the stage makes of the record, not the DHT's store, so it is sent again."""
    deadline = time.monotonic() + timeout
    while not store():
        assert time.monotonic() < deadline, f"{what}: not stored within {timeout:g} s"


class StageOne:
    """Real replicas of stage 1 and other DHT nodes, each node with a key of its own (a signer of its
    own) and joined to the first; all closed at the end, the replicas first."""

    def __init__(self, run: RunConfig):
        self.run = run
        self.nodes: list[hivemind.DHT] = []
        self.replicas: list[SwarmUpdater] = []

    def node(
        self, stage: int | None = None, key: RSAPrivateKey | None = None, client_mode: bool = False
    ) -> hivemind.DHT:
        """A new DHT node (with `key`: signing with it, its peer id derived from it; `client_mode`: it
        dials out only, as behind a home router); with `stage`, a member of it: it has a record there
        for the whole test, as a peer serving the stage announces."""
        if self.nodes:
            dht = make_dht(visible_maddrs(self.nodes[0]), record_key=key or RSAPrivateKey(), client_mode=client_mode)
        else:
            dht = make_dht(record_key=key, client_mode=client_mode)
        self.nodes.append(dht)
        if stage is not None:
            record = PeerRecord(peer_id=dht.peer_id.to_base58(), stage=stage, address="127.0.0.1:1", state="online")
            stored(lambda: announce_peer(dht, self.run.run_id, record, ttl=600, timeout=30), "a member's record")
        return dht

    def replica(self, dht: hivemind.DHT, **kwargs) -> SwarmUpdater:
        """A replica of stage 1 on `dht`, started as a peer starts one: it takes the stage's state."""
        replica = SwarmUpdater(self.run, 1, Stage(self.run, 1), dht, **kwargs)
        self.replicas.append(replica)
        replica.load_state()  # alone it keeps the seeded init; either way it publishes its digest
        return replica

    def close(self) -> None:
        for replica in self.replicas:
            replica.close()
        for dht in self.nodes:
            shutdown_dht(dht)


@swarm_fixture
def stage_one(tmp_path):
    _, run = config_with(tmp_path, FAST_AVERAGING)
    stage = StageOne(run)
    yield stage
    stage.close()


def test_an_idle_stage_fetches_its_progress_seldom_and_at_once_when_it_serves(processes, stage_one, monkeypatch):
    """Idle, a replica's tracker stops fetching the stage's progress every half second (each fetch asks
    every DHT node near the key); the first samples it serves bring a fetch at once."""
    monkeypatch.setattr(TrackerView, "IDLE_AFTER_S", 1.0)
    monkeypatch.setattr(TrackerView, "IDLE_REFRESH_S", 30.0)  # longer than the test: any fetch seen is woken
    a = stage_one.replica(stage_one.node(stage=1))
    fetched: list[float] = []
    parse = a.tracker_view._parse
    a.tracker_view._parse = lambda metadata: (fetched.append(time.monotonic()), parse(metadata))[1]
    time.sleep(3.0)  # idle for longer than IDLE_AFTER_S, and a fetch after that
    fetched.clear()
    time.sleep(4.0)
    assert len(fetched) <= 1, f"{len(fetched)} fetches in 4 s of an idle stage"  # every 0.5 s: 8
    served = time.monotonic()
    a.served(8)
    deadline = served + 10
    while not fetched or fetched[-1] < served:
        assert time.monotonic() < deadline, "no fetch after serving"
        time.sleep(0.02)
    assert a.opt.tracker.global_progress.samples_accumulated == 8


def test_a_replica_waiting_for_its_group_reads_the_group_key_a_few_times_a_second(processes, stage_one, monkeypatch):
    """A replica that reaches a step's matchmaking before the others reads the step's group key from
    the DHT every SpacedLeaders.SPACING_S, not back to back (each read asks every DHT node near the
    key; hivemind's search read it as soon as a read found no leader, some hundred times in 4 s)."""
    reads = multiprocessing.Value("i", 0)  # counted in the averager's process, forked after the patch
    get_averagers = GroupKeyManager.get_averagers

    async def counted(self, *args, **kwargs):
        with reads.get_lock():
            reads.value += 1
        return await get_averagers(self, *args, **kwargs)

    monkeypatch.setattr(GroupKeyManager, "get_averagers", counted)
    a = stage_one.replica(stage_one.node(stage=1))
    averager = a.opt.grad_averager
    averager.expect(2)  # a partner that never comes
    searching = 4.0
    control = averager.schedule_step(scheduled_time=get_dht_time() + 60, timeout=60)
    time.sleep(searching)
    control.cancel()
    assert 1 <= reads.value <= searching / SpacedLeaders.SPACING_S + 2, f"{reads.value} reads in {searching:g} s"


def loads_within_a_step(replica: SwarmUpdater) -> int:
    """How often `replica` loads the stage's state while it looks for the others' digests of its step,
    asked as the worker asks before every request."""
    loads, deadline = 0, time.monotonic() + ReplicaCheck.WAIT_S + 3.0
    while time.monotonic() < deadline:
        if replica.behind(0):
            replica.load_state()
            loads += 1
        time.sleep(0.05)
    return loads


@pytest.mark.parametrize("partner", [True, False], ids=["with a partner", "alone"])
def test_a_replica_told_its_weights_differ_loads_the_stages_state_at_most_once_per_step(
    processes, stage_one, caplog, partner
):
    """Two real replicas of stage 1 with equal weights; three other members of the stage (with a
    record in it, each signed by its own key) publish a majority digest that neither holds. Replica a
    believes it diverged and loads the stage's state from b, which brings nothing new; for the rest of
    the step it must not download the state again and again (the worker asks `behind` before every
    request). Alone (no other replica offers the state, as when the others are behind home routers)
    it has nothing to load, and must not look again and again either (it did, several times a second)."""
    caplog.set_level(logging.INFO, logger="peer.averaging")
    run = stage_one.run
    a = stage_one.replica(stage_one.node(stage=1))
    if partner:
        stage_one.replica(stage_one.node(stage=1))  # b joins and takes a's state
    for liar in [stage_one.node(stage=1) for _ in range(3)]:
        lie = WeightsDigest(peer_id=liar.peer_id.to_base58(), stage=1, step=0, digest="f" * 32)
        stored(functools.partial(publish_digest, liar, run.run_id, lie, timeout=30), "a liar's digest")
    loads = loads_within_a_step(a)
    assert any("differ from the other replicas" in n for n in caplog.messages), caplog.messages
    assert loads == 1, f"{loads} loads of the stage's state within one step"


def test_replicas_tied_on_their_weights_take_those_of_the_one_that_offers_them_not_of_one_behind_a_router(
    processes, stage_one
):
    """Two real replicas of stage 1 whose weights differ: a public one, which offers the stage's state,
    and one behind a home router (client mode: it offers none) with the smaller peer id, the one a tie
    between single holders went to. The public replica was then told its weights differ, had nobody to
    load the others' from, and looked again several times a second for the whole step (in a swarm it
    then missed its step's round, and the two replicas averaged alone). The tie now goes to the
    weights a replica offers: the home replica loads them, once, and the public one keeps its own."""
    public_node = stage_one.node(stage=1)
    key = RSAPrivateKey()
    while signer_peer_id(key.get_public_key().to_bytes().decode()) >= public_node.peer_id.to_base58():
        key = RSAPrivateKey()
    # Both start from the seeded init: the home replica first, alone, then the public one, which finds no
    # state to take (the home replica offers none); neither has loaded the stage's state in this step.
    home = stage_one.replica(stage_one.node(stage=1, key=key, client_mode=True))
    public = stage_one.replica(public_node)
    assert home.opt.dht.peer_id.to_base58() < public_node.peer_id.to_base58()
    deadline = time.monotonic() + 30
    while public_node.peer_id.to_bytes() not in home._state_holders():
        assert time.monotonic() < deadline, "the public replica never offered the stage's state"
        time.sleep(0.1)
    assert home._state_holders() == {public_node.peer_id.to_bytes()}  # the home replica offers none
    with torch.no_grad():
        next(iter(home.held.parameters())).add_(1e-3)  # as a round that left a part out leaves it
    for replica in (public, home):
        replica.check.publish(replica.epoch, weights_digest(replica.held))
    with ThreadPoolExecutor(2) as pool:
        loads = list(pool.map(loads_within_a_step, [public, home]))
    assert loads == [0, 1], f"loads of the stage's state within one step: public {loads[0]}, home {loads[1]}"
    for x, y in zip(public.held.parameters(), home.held.parameters(), strict=True):
        assert torch.equal(x, y)


def test_while_a_step_waits_for_the_norms_one_global_batch_of_training_work_is_served(processes, stage_one, tmp_path):
    """A real worker of stage 1 (of 2) averaging through the DHT serves a global batch, and its step 0
    waits for stage 0's gradient norm. Meanwhile two more global batches of training work arrive (two
    trainers' worth, one naming step 0, one step 1) and a spot check of step 1. While the step waits
    the worker serves one global batch of the training work, set aside for step 1, and no more: were
    its step 1 to hold more samples than stage 0's, the stages' steps would wait on each other's norms
    from then on. The check, compared with other peers' answers, needs step 1's weights: it waits for
    the step. Each step holds exactly one global batch, in the order sent."""
    run = stage_one.run
    run = run.model_copy(update={"averaging": run.averaging.model_copy(update={"sync_timeout_s": 60.0})})
    t = run.training
    stage_one.node()  # the bootstrap node
    stage0 = stage_one.node(stage=0)
    steps_log = tmp_path / "steps.jsonl"
    worker = StageWorker(run, 1, torch.device("cpu"), dht=stage_one.node(stage=1), faults=Faults(log_steps=steps_log))

    def submit(name: str, step: int, train: bool = True):
        x = torch.randn(t.micro_batch, 16, run.model.d_model)
        y = torch.randint(0, run.model.vocab_size, (t.micro_batch, 16))
        return worker.submit(ForwardWork(x, y, train, t.micro_batch / t.global_batch, name, step))

    def norm_of_stage_0(step: int) -> None:
        share = NormShare(peer_id=stage0.peer_id.to_base58(), stage=0, step=step, squared=1.0)
        stored(functools.partial(publish_norm_share, stage0, run.run_id, share, timeout=10), f"norm of step {step}")

    def steps_taken() -> list[list[str]]:
        lines = steps_log.read_text().splitlines() if steps_log.exists() else []
        return [json.loads(line)["microbatches"] for line in lines]

    def until(condition, what: str) -> None:
        deadline = time.monotonic() + 60
        while not condition():
            assert time.monotonic() < deadline, what
            time.sleep(0.02)

    try:
        n = t.accumulation  # microbatches of a global batch
        for future in [submit(f"a{i}", 0) for i in range(n)]:
            future.result(timeout=60)
        until(lambda: worker.stepper.stepping is not None, "step 0 did not start")
        check = submit("check", 1, train=False)
        more = [submit(f"b{i}", 0) for i in range(n)] + [submit(f"c{i}", 1) for i in range(n)]
        for future in more[:n]:
            future.result(timeout=60)  # served while step 0 waits
        time.sleep(1.0)
        assert steps_taken() == [] and worker.stepper.stepping is not None
        assert worker.stepper.stepping.samples == t.global_batch
        assert not any(f.done() for f in more[n:]), "served past the global batch while the step waited"
        assert not check.done(), "a spot check was answered on the weights before the step it names"
        norm_of_stage_0(0)
        check.result(timeout=60)
        for future in more[n:]:
            future.result(timeout=60)  # served while step 1 waits
        until(lambda: len(steps_taken()) == 1, "step 0 was not taken")
        norm_of_stage_0(1)
        until(lambda: len(steps_taken()) == 2, "step 1 was not taken")
        norm_of_stage_0(2)
        until(lambda: len(steps_taken()) == 3, "step 2 was not taken")
        assert steps_taken() == [[f"{x}{i}" for i in range(n)] for x in "abc"]
    finally:
        worker.close()


def test_a_dht_member_outside_the_stages_cannot_forge_a_norm_share_or_a_majority_digest(processes, stage_one, caplog):
    """Two real replicas of stage 1 with equal weights (a, b), a member of stage 0, and three DHT nodes
    that serve no stage. The three publish, signed with their own keys, a digest of step 0 that
    neither replica holds (three against two) and huge and negative norm shares for both stages, one
    in the name of stage 0's member; and, unsigned, more of each. None of it counts: replica a does not
    reload the stage's state, and the global norm is the honest one, from the members' shares."""
    caplog.set_level(logging.INFO, logger="peer.averaging")
    run = stage_one.run
    a = stage_one.replica(stage_one.node(stage=1))
    stage_one.replica(stage_one.node(stage=1))  # b
    stage0 = stage_one.node(stage=0)
    attackers = [stage_one.node() for _ in range(3)]

    expires = get_dht_time() + TTL_S
    digests, shares_key = digest_key(run.run_id, 1), norm_key(run.run_id, 0)
    huge, victim = 1e30, stage0.peer_id.to_base58()
    forged_shares = [(0, huge), (0, -9.0), (1, huge)]  # (stage, squared) of each attacker's own share
    for attacker, (stage, squared) in zip(attackers, forged_shares, strict=True):
        me = attacker.peer_id.to_base58()
        lie = WeightsDigest(peer_id=me, stage=1, step=0, digest="f" * 32)
        stored(functools.partial(publish_digest, attacker, run.run_id, lie, timeout=30), "an attacker's digest")
        share = {"peer_id": me, "stage": stage, "step": 0, "squared": squared}  # as a modified client writes it
        assert attacker.store(shares_key, share, expires, subkey=owned_subkey(attacker, me))
    forger = attackers[0]
    in_victims_name = {"peer_id": victim, "stage": 0, "step": 0, "squared": huge}
    assert forger.store(shares_key, in_victims_name, expires, subkey=owned_subkey(forger, victim))
    # Unsigned: subkeys without an owner, in the old key schema's form (the stage as the subkey;
    # hivemind compares the subkeys of equal expiration times, and an int beside strings raises)
    # and in the records' form.
    assert forger.store(shares_key, huge, expires + 1, subkey=0)
    assert forger.store(shares_key, dict(in_victims_name, peer_id="0"), expires, subkey="0")
    for fake in ("0", "1", "2"):
        unsigned = {"peer_id": fake, "stage": 1, "step": 0, "digest": "f" * 32}
        assert forger.store(digests, unsigned, expires, subkey=fake)

    # Pushed straight to replica a's node as well (swarm/norms.py), raw, as a modified client sends
    # them: each attacker's own id is the sender whatever the message says, so none can speak for
    # stage 0's member, and a non-member's share, however well-formed, counts for no stage.
    a_id = a.opt.dht.peer_id.to_base58()
    for attacker, (stage, squared) in zip(attackers, [*forged_shares, (0, float("nan"))][:3], strict=True):
        raw = pb.NormSharePush(run_id=run.run_id, stage=stage, step=0, squared=squared).SerializeToString()
        attacker.run_coroutine(functools.partial(norms._push, targets=[a_id], message=raw))
    pushed = {s.peer_id for s in norms.received(a.opt.dht, run.run_id, 0)}
    assert pushed == {attackers[0].peer_id.to_base58(), attackers[2].peer_id.to_base58()}  # -9 is refused

    assert loads_within_a_step(a) == 0
    assert not any("differ from the other replicas" in n for n in caplog.messages), caplog.messages

    NormExchange(stage0, run.run_id, run.stages.count, 0, timeout=30).publish(0, 9.0)
    a.norms.step = 0
    assert a.norms(16.0) == pytest.approx(5.0)  # sqrt(9 + 16): stage 0's share and its own
    assert not any("no gradient norm" in n for n in caplog.messages), caplog.messages


def test_a_norm_share_is_pushed_to_the_other_stages_members_without_the_dht(processes, stage_one):
    """Stage 0's member publishes its share of step 3; the member of stage 1 has it pushed straight to
    its DHT process, with the sender's own peer id, and takes the global norm from it without reading
    the DHT's records at all."""
    run = stage_one.run
    one, zero = stage_one.node(stage=1), stage_one.node(stage=0)
    receiver = NormExchange(one, run.run_id, run.stages.count, 1, timeout=30)
    receiver.DHT_READ_AFTER_S = float("inf")  # the pushed shares alone
    NormExchange(zero, run.run_id, run.stages.count, 0, timeout=30).publish(3, 9.0)
    receiver.step = 3
    assert receiver(16.0) == pytest.approx(5.0)
    [share] = norms.received(one, run.run_id, 3)
    assert (share.peer_id, share.stage, share.squared) == (zero.peer_id.to_base58(), 0, 9.0)
    assert norms.received(one, run.run_id, 2) == [] and norms.received(one, "another-run", 3) == []


def test_what_senders_can_make_a_node_keep_of_pushed_shares_is_bounded(monkeypatch):
    """A sender flooding shares leaves only its last KEEP; past MAX_SENDERS senders, the one heard from
    longest ago is forgotten."""
    monkeypatch.setattr(norms, "_received", type(norms._received)())
    for step in range(norms.KEEP + 50):
        norms.keep("flooder", pb.NormSharePush(run_id="r", stage=0, step=step, squared=1.0))
    assert [share[2] for share in norms._received["flooder"]] == list(range(50, norms.KEEP + 50))
    for n in range(norms.MAX_SENDERS):
        norms.keep(f"sybil{n}", pb.NormSharePush(run_id="r", stage=0, step=0, squared=1.0))
    assert len(norms._received) == norms.MAX_SENDERS and "flooder" not in norms._received


# A replica that is alive (it answers pings, it reports samples toward the step) and never joins a
# round. It runs in a process of its own: hivemind signs progress reports with one key per process.
IDLE_PARTNER = """
import sys, time
from hivemind.optim.progress_tracker import ProgressTracker
from swarm.records import make_dht
dht = make_dht(sys.argv[3:])
tracker = ProgressTracker(dht=dht, prefix=sys.argv[1], target_batch_size=int(sys.argv[2]), start=True)
tracker.report_local_progress(0, 1)
print("reporting", flush=True)
time.sleep(600)
"""


@contextlib.contextmanager
def replica_and_idle_partner(tmp_path):
    """A real replica of stage 1 (averaging_timeout_s 120 s) and an IDLE_PARTNER it sees; yields the
    replica and the partner's process."""
    _, run = config_with(tmp_path, FAST_AVERAGING + "averaging_timeout_s = 120.0\nsync_timeout_s = 1.0\n")
    stage = StageOne(run)
    with contextlib.ExitStack() as stack:
        stack.callback(stage.close)
        a = stage.replica(stage.node(stage=1))
        idle = stack.enter_context(idle_partner(a))
        for p in a.module.parameters():
            p.grad = torch.full_like(p, 1e-3)
        yield a, idle


@contextlib.contextmanager
def idle_partner(a: SwarmUpdater):
    """An IDLE_PARTNER of replica `a` (its process, in a session of its own), once `a` sees it live and
    counted; killed with its DHT node and p2pd at the end."""
    run = a.run
    prefix = averaging_prefix(run.run_id, 1)
    args = [sys.executable, "-c", IDLE_PARTNER, prefix, str(run.training.global_batch), *visible_maddrs(a.opt.dht)]
    idle = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert idle.stdout.readline().strip() == "reporting"
        a.opt.tracker.report_local_progress(a.epoch, 1)  # as serving does
        deadline = time.monotonic() + 30
        while not live_partners(a.opt) or a.opt.tracker.global_progress.num_peers < 2:
            assert time.monotonic() < deadline, "the replica never saw its partner"
            time.sleep(0.1)
        yield idle
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(idle.pid, signal.SIGKILL)  # its DHT node and p2pd too
        idle.wait()


def step_until_taken(replica: SwarmUpdater, samples: int, timeout: float, force: bool = False) -> int:
    """The replica's step, tried again while it takes none (the stage's count changed between the check
    and the step: a partner's report that came or went), as the worker's stepper tries again."""
    deadline = time.monotonic() + timeout
    while (used := replica.step(samples, force=force)) == 0:
        assert time.monotonic() < deadline, f"the replica took no step in {timeout:.0f} s"
        time.sleep(0.05)
    return used


def timed_step(a: SwarmUpdater) -> float:
    started = time.monotonic()
    assert step_until_taken(a, a.run.training.global_batch, timeout=60, force=True) == a.run.training.global_batch
    assert a.epoch == 1
    return time.monotonic() - started


def test_a_round_stalled_with_a_live_partner_is_cut_at_the_stall_bound(processes, tmp_path, caplog):
    """The partner is alive but never steps, so the replica's all-reduce finds no group until
    averaging_timeout_s (120 s). After rounds of about 0.2 s, the bound is one matchmaking plus one
    chunk timeout (5.5 s): the replica steps with its own gradient well before, and says why."""
    caplog.set_level(logging.WARNING, logger="swarm.averaging")
    with replica_and_idle_partner(tmp_path) as (a, _):
        a.rounds.extend([0.2, 0.2, 0.2])
        assert a._stall_s() == pytest.approx(0.5 + 5.0)
        elapsed = timed_step(a)
        assert elapsed < 30, f"the step took {elapsed:.1f} s"
        assert any("ran over 5.5 s" in m for m in caplog.messages), caplog.messages


def test_work_after_a_round_that_left_a_live_partner_out_waits_until_the_digests_settle(processes, tmp_path):
    """The partner is live but never steps: the replica's round is cut at the stall bound and it steps
    alone, its weights now its own. Work naming the step it reached (`catch_up`, which the worker runs
    before every request) must wait until the replicas' digests of the step say whether these are the
    stage's weights; here none comes, so until ReplicaCheck.WAIT_S after its own. Answered at once, it
    was computed on weights no other replica held: a spot check comparing it with another replica's
    answer outvoted the honest peer, and two such strikes banned it."""
    with replica_and_idle_partner(tmp_path) as (a, _):
        a.rounds.extend([0.2, 0.2, 0.2])  # the stall bound: 5.5 s
        timed_step(a)
        assert a.last_step["group"] == 1 and a.settling()
        stepper = Stepper(a.run, 1, a.module, a, threading.Lock(), lambda: False, lambda: None)
        stepper.catch_up(a.epoch)
        assert not a.settling() and a.check.settled
        waited = time.monotonic() - a.check.published_at
        assert waited >= ReplicaCheck.WAIT_S, f"work was let through {waited:.2f} s after the lone step"


def test_work_after_a_lone_round_goes_on_once_the_partner_it_waited_for_is_dead(processes, tmp_path):
    """As above, but the partner dies after the round (SIGKILL of its process group; its progress
    report stays in the DHT until it expires): no digest will come, these weights are the stage's, and
    work goes on at once instead of ReplicaCheck.WAIT_S after the step. Waiting it out stalled the
    trainer about 5 s after one peer of a 2 x 2 swarm was killed mid-round."""
    with replica_and_idle_partner(tmp_path) as (a, idle):
        a.rounds.extend([0.2, 0.2, 0.2])
        timed_step(a)
        assert a.last_step["group"] == 1 and a.settling()
        os.killpg(idle.pid, signal.SIGKILL)
        idle.wait()
        assert tracked_partners(a.opt), "the dead partner's report expired already: nothing was tested"
        weights = [p.detach().clone() for p in a.module.parameters()]
        stepper = Stepper(a.run, 1, a.module, a, threading.Lock(), lambda: False, lambda: None)
        stepper.catch_up(a.epoch)
        waited = time.monotonic() - a.check.published_at
        assert not a.settling() and a.check.settled
        assert waited < ReplicaCheck.WAIT_S - 1, f"work waited {waited:.2f} s after the lone step for a dead partner"
        # Nothing was loaded: the lone replica's weights are the stage's.
        assert all(torch.equal(w, p) for w, p in zip(weights, a.module.parameters(), strict=True))


def test_a_partner_killed_before_a_step_stays_out_of_hiveminds_count_until_its_report_expires(processes, tmp_path):
    """The partner's whole process group is killed; its progress report stays in the DHT until it
    expires. The replica steps alone at once, and hivemind's tracker, fetching again and again, does not
    count the dead partner: a fetch that did used to bring it back between the replica's check and
    hivemind's step, and hivemind then looked for a group with it for averaging_timeout_s."""
    with replica_and_idle_partner(tmp_path) as (a, idle):
        os.killpg(idle.pid, signal.SIGKILL)
        idle.wait()
        elapsed = timed_step(a)
        assert elapsed < 30, f"the step took {elapsed:.1f} s"
        time.sleep(2.0)  # fetches every 0.25 to 0.5 s
        assert tracked_partners(a.opt), "the dead partner's report expired already: nothing was tested"
        assert a.opt.tracker.global_progress.num_peers <= 1, a.opt.tracker.global_progress


def test_a_replica_taking_the_stages_state_does_not_wait_out_the_round_it_had_scheduled(processes, tmp_path):
    """Replica b has a gradient round scheduled (hivemind's Optimizer schedules a step's round ahead
    of it) that nobody joins, and takes the stage's state from a, as a peer that moved into the stage
    or missed its steps does. hivemind's load_state_from_peers tags along with such a round at zero
    weight and waits for it, up to averaging_timeout_s (120 s here): a peer that moved into the stage
    of a 2 x 2 swarm held its calls for 100 s so. A round that has not begun is dropped instead."""
    _, run = config_with(tmp_path, FAST_AVERAGING + "averaging_timeout_s = 120.0\n")
    stage = StageOne(run)
    try:
        stage.replica(stage.node(stage=1))  # a: holds the stage's state, never averages
        b = stage.replica(stage.node(stage=1))
        b.opt.scheduled_grads = b.opt.grad_averager.schedule_step(
            get_dht_time() + run.averaging.matchmaking_time_s, timeout=run.averaging.averaging_timeout_s
        )
        started = time.monotonic()
        b.load_state()
        elapsed = time.monotonic() - started
        assert elapsed < 20, f"taking the stage's state took {elapsed:.1f} s"
        assert b.opt.scheduled_grads is None
    finally:
        stage.close()


@pytest.mark.parametrize("served", ["half", "none"])
def test_a_step_whose_missing_samples_died_with_a_partner_is_taken_once_the_other_stages_are_done(
    processes, tmp_path, served
):
    """A real worker of stage 1 (of 2) serves half a global batch, or none of it; its partner, which
    reported one sample (a replica killed after it answered its calls, before its report counted
    them), holds the rest. Stage 0 publishes its gradient norm of the step: its part of the step is
    done. While the partner lives, the worker waits for it; once the partner is killed (its report
    stays in the DHT until it expires), what the count lacks died with it, and the worker takes the
    step short (or with nothing), at once. It used to wait until work for the next step came and then
    `sync_timeout_s` more (60 s here; in a 2 x 2 swarm, 5 s, while stage 0 waited as long for this
    stage's norm): no work comes in this test, so the old worker never steps."""
    _, run = config_with(tmp_path, FAST_AVERAGING + "averaging_timeout_s = 120.0\nsync_timeout_s = 60.0\n")
    t = run.training
    stage = StageOne(run)
    stage.node()  # the bootstrap node
    stage0 = stage.node(stage=0)
    steps_log = tmp_path / "steps.jsonl"
    worker = StageWorker(run, 1, torch.device("cpu"), dht=stage.node(stage=1), faults=Faults(log_steps=steps_log))

    def steps_taken() -> list[list[str]]:
        lines = steps_log.read_text().splitlines() if steps_log.exists() else []
        return [json.loads(line)["microbatches"] for line in lines]

    try:
        with idle_partner(worker.updater) as partner:
            half = [f"a{i}" for i in range(t.accumulation // 2)] if served == "half" else []
            for name in half:
                x = torch.randn(t.micro_batch, 16, run.model.d_model)
                y = torch.randint(0, run.model.vocab_size, (t.micro_batch, 16))
                worker.submit(ForwardWork(x, y, True, t.micro_batch / t.global_batch, name, 0)).result(timeout=60)
            NormExchange(stage0, run.run_id, run.stages.count, 0, timeout=30).publish(0, 1.0)
            time.sleep(4.0)  # the quiet time and a few looks: the partner answers its pings
            assert steps_taken() == [], "stepped short of the count while the partner that holds the rest lived"
            os.killpg(partner.pid, signal.SIGKILL)
            partner.wait()
            killed = time.monotonic()
            assert tracked_partners(worker.updater.opt), "the partner's report expired already: nothing was tested"
            while not steps_taken():
                assert time.monotonic() - killed < 20, "no step 20 s after the partner holding the rest died"
                time.sleep(0.05)
        assert steps_taken() == [half]
        assert worker.updater.last_step["samples"] == t.micro_batch * len(half)
    finally:
        worker.close()
        stage.close()


def drifted_log(line: str) -> bool:
    """A peer's log line that can say why its replica drifted from the others: a warning or error
    (a round that failed or lost parts), a step, a state loaded, a digest that disagreed."""
    return any(word in line for word in ("WARNING", "ERROR", "step", "load", "digest", "round"))


def train_and_assert_replicas_equal(swarm, run, names: list[str], steps: int) -> dict:
    """Train `steps` steps on the swarm of peers a0, b0 (stage 0) and a1, b1 (stage 1), already online;
    check that every step completed, that the replicas of each stage hold the same bits at the same
    step and that they trained. Returns each peer's (step, weights)."""
    swarm.train(steps=steps)
    records = swarm.finish_training()
    assert [r["step"] for r in records] == list(range(steps))

    s = state(swarm.url)
    # The stages started from the seeded init, and the records say so.
    assert {peer_record(s, n)["weights_from"] for n in names} == {"the seeded init"}
    held = {}
    for a, b in (("a0", "b0"), ("a1", "b1")):
        # The same bits, with a lossy codec too: every replica copies in the reducers' averages. A round
        # that left a replica out (it began its part of the all-reduce too late on a loaded machine) sets
        # them apart for a moment: the replica check has one load the other's weights within its WAIT_S
        # of the step (peer/replica_check.py), with no more work coming. A full run read them 0.0006 apart
        # at once, after the last step's outer round had left b1 out.
        deadline = time.monotonic() + ReplicaCheck.WAIT_S + 20
        while True:
            held.update({n: parameters(swarm.url, run, peer_record(s, n)) for n in (a, b)})
            drift = max_difference(held[a][1], held[b][1])
            if drift == 0.0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert held[a][0] == held[b][0] == steps, f"{a} and {b} took {held[a][0]} and {held[b][0]} steps"
        assert drift == 0.0, f"{a} and {b} drifted apart by {drift:g}; what they logged:\n" + "\n".join(
            f"{n}: {line}" for n in (a, b) for line in swarm.peers[n].output().splitlines() if drifted_log(line)
        )
    # ... and they did train: the weights moved away from the seeded init. Three steps into a 20-step
    # warmup to 3e-3 move a weight by up to 4.5e-4, six by about 1e-3 (AdamW moves each by up to the
    # learning rate a step), less after a DiLoCo outer step averages replicas that moved apart;
    # untrained, by 0.
    init = dict(Stage(run, 1).named_parameters())
    assert max_difference({n: t.detach() for n, t in init.items()}, held["a1"][1]) > 1e-4
    return held


def test_replicas_stay_equal_and_a_late_joiner_serves_the_current_weights(averaging_swarm):
    # Gradient averaging rounds every step: 3 steps make 3 rounds. DiLoCo's phases are 3 steps: 6 end
    # with the second outer step.
    swarm, run = averaging_swarm, averaging_swarm.run
    steps = 6 if run.averaging.mode == "diloco" else 3
    names = {"a0": 0, "b0": 0, "a1": 1, "b1": 1}
    for name, stage in names.items():
        swarm.add_peer(name, stage)
    swarm.wait_online(list(names))
    held = train_and_assert_replicas_equal(swarm, run, list(names), steps)

    # A peer joining now takes the stage's weights, optimizer state and step from the others.
    swarm.add_peer("late1", 1)
    s = swarm.wait_online(["late1"])
    late = peer_record(s, "late1")
    assert late["weights_from"] == f"peers of stage 1 at step {steps}", late
    assert late["optimizer_steps"] == steps

    assert max_difference(parameters(swarm.url, run, late)[1], held["a1"][1]) <= 1e-6

    # Its first served forward gives what an old replica gives for the same input.
    x = torch.randn(2, run.model.seq_len, run.model.d_model)
    targets = encode(torch.randint(0, run.model.vocab_size, (2, run.model.seq_len)))
    outputs = {}
    for name in ("late1", "a1"):
        client = member_client(swarm.url, run, peer_record(s, name))
        try:
            response = client.forward(1, encode(x), f"probe-{name}", steps, targets=targets, train=False)
        finally:
            client.close()
        outputs[name] = response.loss
    assert outputs["late1"] == pytest.approx(outputs["a1"], abs=1e-6), outputs

    if run.averaging.mode == "diloco":
        # One inner step more moves the replicas' own weights apart, but what a Parameters call (and
        # so `swarm export`) reads stays the stage's outer weights, of the last outer step, on each.
        swarm.train(1)
        swarm.finish_training()
        # The trainer is done once its last backward is answered; a replica's step and record come after.
        s = wait_for_state(
            swarm.url,
            lambda s: max(peer_record(s, n)["optimizer_steps"] for n in ("a1", "b1", "late1")) == steps + 1,
            timeout=60,
        )
        for name in ("a1", "b1", "late1"):
            step, tensors = parameters(swarm.url, run, peer_record(s, name))
            assert step == steps and max_difference(tensors, held["a1"][1]) <= 1e-6, name


def test_unequal_peers_rebalance_to_within_ten_percent_of_the_best_assignment(processes, tmp_path):
    period = 3.0
    path, _ = config_with(tmp_path, f"\n[rebalance]\nperiod_s = {period}\n")
    swarm = Swarm(tmp_path, path)
    # The delay stands in for a slower device: it lowers the throughput the peer measures.
    delays = {"u0": 0.0, "u1": 0.02, "u2": 0.05, "u3": 0.1}
    try:
        for name, delay in delays.items():
            swarm.add_peer(name, 0, "--delay-per-sample", str(delay), rebalance=True)
        swarm.wait_online(list(delays))
        speeds = {p["public_name"]: p["throughput"] for st in state(swarm.url)["stages"] for p in st["peers"]}
        assert speeds["u0"] > 1.5 * speeds["u3"], speeds
        optimum = best_min_total(list(speeds.values()), 2)

        # Every move needs one check period (randomised up to 1.5x) and a join on the new stage.
        def settled(s: dict) -> bool:
            return len(online_names(s)) == 4 and min(stage_totals(s)) >= 0.9 * optimum

        s = wait_for_state(swarm.url, settled, timeout=4 * 1.5 * period + 40)
        moves = sum(p.output().count("moving from stage") for p in swarm.peers.values())
        time.sleep(3 * period)  # the swarm is unchanged: nobody moves again
        assert sum(p.output().count("moving from stage") for p in swarm.peers.values()) == moves
        assert min(stage_totals(state(swarm.url))) >= 0.9 * optimum, (stage_totals(s), optimum, speeds)
    finally:
        swarm.close()


def test_a_round_closes_once_every_live_replica_joined_not_at_the_end_of_matchmaking(processes, tmp_path):
    """Two real replicas of stage 1 with a matchmaking time of 10 s take a step together: the group is
    complete once both have joined, and the round ends long before the 10 s. Without a target group
    size, hivemind's leader waits out its whole matchmaking time at every step."""
    from tests.test_diloco import take_step, two_replicas  # it imports this module

    extra = "\n[averaging]\nmatchmaking_time_s = 10.0\nrequest_timeout_s = 1.0\nsync_timeout_s = 1.0\n"
    _, run = config_with(tmp_path, extra + "averaging_timeout_s = 60.0\n")
    stage = StageOne(run)
    try:
        a, b, _, ga, gb, half = two_replicas(stage)
        take_step([a, b], [ga, gb], half)
        for replica in (a, b):
            assert replica.last_step["group"] == 2, replica.last_step
            assert replica.last_step["s"] - replica.norms.waited < 5.0, replica.last_step
            # The round's key named its step, and stays so once the group assembled (hivemind would move
            # each member's bits on by its index: a retry of the round would look apart from its partner).
            assert replica.opt.grad_averager.get_group_bits() == step_bits(0)
    finally:
        stage.close()


def test_a_replica_still_in_the_round_of_a_step_does_not_average_with_the_others_next_step(processes, tmp_path, caplog):
    """Replica a is in the round of step 0 (its batch is complete; b, live, has not joined) when b moves
    past step 0 without it and takes step 1. hivemind's matchmaking knows no steps: a joined b's round
    of step 1, applying b's step-1 gradient to its step-0 weights. Now each round's group key names
    its step: a's round of step 0 ends as soon as a sees b past it, with a's own gradient, and no
    round holds both."""
    from tests.test_diloco import gradient, see_each_other, serve, wait_ready  # it imports this module

    caplog.set_level(logging.WARNING, logger="swarm.averaging")
    # a's round waits up to the matchmaking time for b to join.
    extra = "\n[averaging]\nmatchmaking_time_s = 5.0\nrequest_timeout_s = 0.3\naveraging_timeout_s = 8.0\n"
    _, run = config_with(tmp_path, extra + "sync_timeout_s = 1.0\n")
    stage, batch = StageOne(run), run.training.global_batch
    try:
        a = stage.replica(stage.node(stage=1))
        b = stage.replica(stage.node(stage=1))
        serve(a, gradient(run, 1), batch)
        b.opt.tracker.report_local_progress(b.epoch, 1)  # as serving does
        see_each_other([a, b])
        deadline = time.monotonic() + 30
        while a.opt.tracker.global_progress.num_peers < 2:  # else hivemind begins no round
            assert time.monotonic() < deadline, "a's tracker never counted b"
            time.sleep(0.05)
        wait_ready(a, batch)
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(step_until_taken, a, batch, 60)
            deadline = time.monotonic() + 30
            while (control := a.opt.scheduled_grads) is None or control.stage != AveragingStage.LOOKING_FOR_GROUP:
                assert time.monotonic() < deadline and not first.done(), f"a's round never began: {a.last_step}"
                time.sleep(0.02)
            b.skip_to(1)  # b left step 0 without a (as after a round of its own)
            serve(b, gradient(run, 2), batch)
            wait_ready(b, batch)
            assert step_until_taken(b, batch, 60) == batch
            assert first.result() == batch
        assert (a.epoch, b.epoch) == (1, 2)
        assert a.last_step["step"] == 0 and a.last_step["group"] == 1, a.last_step
        assert b.last_step["step"] == 1 and b.last_step["group"] == 1, b.last_step
        assert any("moved past step 0" in m for m in caplog.messages), caplog.messages
    finally:
        stage.close()


def test_replicas_offer_their_state_for_download_and_never_their_gradients(processes, stage_one):
    """After a step averaged by two real replicas, the DHT lists both as holders of the stage's state
    (a joiner loads it from them) and neither as holder of a gradient averager's state, which nobody
    loads. Offered, hivemind re-announced that offer on every tensor a round averaged: a DHT store
    to every node each time, a third of a 2 x 2 swarm's DHT traffic."""
    from tests.test_diloco import take_step, two_replicas  # it imports this module

    a, b, _, ga, gb, half = two_replicas(stage_one)
    take_step([a, b], [ga, gb], half)
    assert a.last_step["group"] == b.last_step["group"] == 2, (a.last_step, b.last_step)
    prefix = averaging_prefix(stage_one.run.run_id, 1)

    def holders(key: str) -> set[bytes]:
        found = a.opt.dht.get(key, latest=True)
        value = found.value if found is not None and isinstance(found.value, dict) else {}
        return {subkey for subkey, item in value.items() if item.value is not None}

    replicas = {a.opt.dht.peer_id.to_bytes(), b.opt.dht.peer_id.to_bytes()}
    deadline = time.monotonic() + 10  # the offers go out asynchronously
    while holders(state_holders_key(prefix)) != replicas:
        assert time.monotonic() < deadline, holders(state_holders_key(prefix))
        time.sleep(0.2)
    assert holders(f"{prefix}_grad_averager.all_averagers") == set()
