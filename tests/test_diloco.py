"""DiLoCo inside a stage (`[averaging] mode = "diloco"`, peer/diloco.py): real replicas of stage 1,
each on a DHT node of its own, driven step by step in one process: inner steps apart, an outer step
that leaves them bitwise equal at the value DiLoCo's update gives, a joiner mid-phase that takes the
outer weights and momentum, an outer step that waits for a live replica one step behind (it served none
of the last step's samples) but not for a DHT member outside the stage that says it is, and a replica
whose partner left (closed, or SIGKILLed in a process of its own) keeping its own inner progress."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hivemind.utils import get_dht_time

from peer import stage_optimizer
from peer.averaging import SwarmUpdater
from peer.checkpoint import Snapshot, check_checkpoint, write_checkpoint
from peer.replica_check import weights_digest
from peer.rounds import live_partners
from swarm.model import Stage
from swarm.optim import make_optimizer, param_groups, primed
from swarm.records import TTL_S, averaging_prefix, visible_maddrs
from swarm.schedule import lr_at
from tests.processes import ROOT
from tests.test_averaging import FAST_AVERAGING, StageOne, config_with, step_until_taken

H = 3  # inner steps per phase
ROUND_S = 60.0  # averaging_timeout_s
REPORT_TTL_S = 6.0  # how long a progress report lives where a test waits for one to expire
CHUNK_S = 30.0  # chunk_timeout_s


def diloco_stage(tmp_path, outer: str) -> StageOne:
    """Stage 1 of a DiLoCo run with H inner steps; `outer`: the [averaging] lines of the outer step."""
    # A round that waited for a replica that left would last averaging_timeout_s: far above a step's time.
    # A group is complete, and its round starts, once every live replica has joined (`expect`); the
    # matchmaking time bounds only how long the leader waits for one that is slow to join: at 0.5 s,
    # a joiner on a loaded 2-core CI machine once missed the outer round of the other two.
    fast = FAST_AVERAGING.replace("matchmaking_time_s = 0.5", "matchmaking_time_s = 2.0")
    # A part of the all-reduce later than chunk_timeout_s is left out, and the replicas then end the round
    # apart (the digests settle that in a real run): the default 5 s cut a part of an outer round on a
    # loaded 2-core CI machine ("received 92.3% results"), and these tests ask for bitwise-equal replicas.
    extra = fast + (
        f'mode = "diloco"\ninner_steps = {H}\n{outer}sync_timeout_s = 1.0\naveraging_timeout_s = {ROUND_S}\n'
        f"chunk_timeout_s = {CHUNK_S}\n"
    )
    _, run = config_with(tmp_path, extra)
    return StageOne(run)


@pytest.fixture
def stage_one(tmp_path):
    """With an outer Nesterov momentum, so that its handling (joiners, checkpoints) is tested."""
    stage = diloco_stage(tmp_path, "outer_lr = 0.7\nouter_momentum = 0.5\n")
    yield stage
    stage.close()


@pytest.fixture
def plain_stage(tmp_path):
    """With the default outer step: outer_lr 1 and no momentum, the plain average of the replicas' weights."""
    stage = diloco_stage(tmp_path, "")
    yield stage
    stage.close()


def gradient(run, seed: int) -> list[torch.Tensor]:
    """A gradient for stage 1's parameters, different per seed."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g) * 1e-2 for p in Stage(run, 1).parameters()]


def weights(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def serve(replica: SwarmUpdater, grad: list[torch.Tensor], samples: int) -> None:
    """As the worker does: the step's gradient, `samples`/global batch of this replica's mean."""
    share = samples / replica.run.training.global_batch
    for p, g in zip(replica.module.parameters(), grad, strict=True):
        p.grad = g * share
    replica.served(samples)


def see_each_other(replicas: list[SwarmUpdater], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while any(len(live_partners(r.opt)) < len(replicas) - 1 for r in replicas):
        assert time.monotonic() < deadline, "the replicas never saw each other"
        time.sleep(0.1)


def wait_ready(replica: SwarmUpdater, samples: int, timeout: float = 30) -> None:
    """Until the stage's count, with `samples` of this replica's, reaches the global batch (as the stepper waits)."""
    deadline = time.monotonic() + timeout
    while not replica.ready(samples):
        assert time.monotonic() < deadline, "the stage's count never reached the global batch"
        time.sleep(0.05)


def take_step(replicas: list[SwarmUpdater], grads: list[list[torch.Tensor]], samples: int) -> None:
    """One global step on every replica at once (an all-reduce, or diloco's outer step, needs them together)."""
    for r, g in zip(replicas, grads, strict=True):
        serve(r, g, samples)
    a = replicas[0].run.averaging
    if len(replicas) > 1 and (a.mode == "gradients" or (replicas[0].epoch + 1) % a.inner_steps == 0):
        see_each_other(replicas)
    for r in replicas:
        wait_ready(r, samples)
    before = [r.epoch for r in replicas]
    with ThreadPoolExecutor(len(replicas)) as pool:
        used = list(pool.map(lambda r: step_until_taken(r, samples, ROUND_S), replicas))
    assert used == [samples] * len(replicas)
    assert [r.epoch for r in replicas] == [b + 1 for b in before]


def inner_phase(run, start: list[torch.Tensor], grads: list[list[torch.Tensor]], first: int) -> list[torch.Tensor]:
    """What one replica's AdamW makes of `start` with gradient `grads[k]` at step first + k."""
    module = Stage(run, 1)
    with torch.no_grad():
        for p, w in zip(module.parameters(), start, strict=True):
            p.copy_(w)
    opt = primed(make_optimizer(param_groups(module, run.training.weight_decay), run))
    for k, grad in enumerate(grads):
        for p, g in zip(module.parameters(), grad, strict=True):
            p.grad = g.clone()
        for group in opt.param_groups:
            group["lr"] = lr_at(first + k, run.training)
        opt.step()
    return weights(module)


def two_replicas(stage: StageOne) -> tuple[SwarmUpdater, SwarmUpdater, list[torch.Tensor], list, list, int]:
    """Replicas a and b of stage 1, the weights they start from, a gradient for each, and half the
    global batch (what each serves per step)."""
    a = stage.replica(stage.node(stage=1))
    b = stage.replica(stage.node(stage=1))
    run = stage.run
    return a, b, weights(a.module), gradient(run, 1), gradient(run, 2), run.training.global_batch // 2


def test_an_outer_step_averages_the_pseudo_gradients_and_leaves_the_replicas_bitwise_equal(processes, stage_one):
    run = stage_one.run
    a, b, start, ga, gb, half = two_replicas(stage_one)
    digest = weights_digest(a.held)
    for _ in range(H - 1):
        take_step([a, b], [ga, gb], half)
        assert weights_digest(a.held) == weights_digest(b.held) == digest  # the outer weights stay
        assert a.last_step["reduced_bytes"] == 0  # nothing averaged in an inner step
    differ = max((x - y).abs().max().item() for x, y in zip(weights(a.module), weights(b.module), strict=True))
    assert differ > 0, "inner steps on different gradients left the replicas equal"

    take_step([a, b], [ga, gb], half)  # the phase's last step: the outer step
    assert a.last_step["group"] == b.last_step["group"] == 2, (a.last_step, b.last_step)
    assert a.last_step["reduced_bytes"] > 0
    for x, y in zip(weights(a.module), weights(b.module), strict=True):
        assert torch.equal(x, y), "the replicas left the outer step apart"
    assert weights_digest(a.module) == weights_digest(a.held)

    # DiLoCo's update: pseudo-gradients averaged (equal samples: equal weights), then Nesterov SGD,
    # whose first step with an empty buffer is (1 + momentum) x the gradient.
    inner_a = inner_phase(run, start, [ga] * H, 0)
    inner_b = inner_phase(run, start, [gb] * H, 0)
    av = run.averaging
    for got, s, x, y in zip(weights(a.module), start, inner_a, inner_b, strict=True):
        pseudo = ((s - x) + (s - y)) / 2
        expected = s - av.outer_lr * (1 + av.outer_momentum) * pseudo
        assert torch.allclose(got, expected, atol=1e-6), (got - expected).abs().max()
    assert max((x - s).abs().max().item() for x, s in zip(weights(a.module), start, strict=True)) > 1e-4


def test_a_replica_that_an_earlier_try_left_a_scheduled_round_counts_the_group_it_averaged_in(processes, stage_one):
    """A try of the step that found the stage's count short leaves hivemind's round scheduled, not yet
    used, and the next try uses that round: the replica averaged in a group of 2 and says so (it
    said 1, as if it had stepped alone, and then settled digests it had no reason to doubt)."""
    a, b, _, ga, gb, half = two_replicas(stage_one)
    for _ in range(H - 1):
        take_step([a, b], [ga, gb], half)
    b.opt.scheduled_grads = b.opt.grad_averager.schedule_step(timeout=ROUND_S)  # as hivemind schedules it
    take_step([a, b], [ga, gb], half)
    assert a.last_step["group"] == b.last_step["group"] == 2, (a.last_step, b.last_step)
    assert not b.lone
    for x, y in zip(weights(a.module), weights(b.module), strict=True):
        assert torch.equal(x, y)


def test_within_a_phase_the_stages_agreed_weights_are_the_outer_ones_of_the_last_outer_step(processes, stage_one):
    """What a Parameters call (and so `swarm export`) reads: every replica of the stage hands over the
    same weights at the same step mid-phase, the outer ones, not its own inner weights."""
    a, b, start, ga, gb, half = two_replicas(stage_one)
    take_step([a, b], [ga, gb], half)
    assert a.agreed_step == b.agreed_step == 0
    assert all(torch.equal(x, s) for r in (a, b) for x, s in zip(r.agreed_weights(), start, strict=True))
    for _ in range(H):  # the outer step, then one inner step of the next phase
        take_step([a, b], [ga, gb], half)
    assert (a.epoch, a.agreed_step, b.agreed_step) == (H + 1, H, H)
    outer = weights(a.held)
    assert any(not torch.equal(x, y) for x, y in zip(weights(a.module), weights(b.module), strict=True))
    for r in (a, b):
        assert all(torch.equal(x, y) for x, y in zip(r.agreed_weights(), outer, strict=True))
        assert any(not torch.equal(x, y) for x, y in zip(r.agreed_weights(), weights(r.module), strict=True))


def test_a_checkpoint_taken_at_an_outer_step_gives_back_the_outer_momentum(processes, stage_one, tmp_path):
    """A resumed replica continues the outer Nesterov step where it was, not from a momentum of 0."""
    run = stage_one.run
    a, b, _, ga, gb, half = two_replicas(stage_one)
    for _ in range(H):
        take_step([a, b], [ga, gb], half)
    outer = a.outer_optimizer
    momentum = [outer.state[p]["momentum_buffer"].clone() for p in a.held.parameters()]
    assert momentum[0].abs().sum() > 0
    saved = write_checkpoint(tmp_path, run, 1, Snapshot.take(a.module, a.optimizer, a.epoch, outer))
    for p in a.held.parameters():
        outer.state[p]["momentum_buffer"].zero_()
    a.load_checkpoint(check_checkpoint(saved, run, 1))
    assert a.epoch == H
    for p, m in zip(a.held.parameters(), momentum, strict=True):
        assert torch.equal(outer.state[p]["momentum_buffer"], m)


def test_the_default_outer_step_is_the_average_of_the_inner_weights_and_joiners_and_checkpoints_take_it(
    processes, plain_stage, tmp_path
):
    """outer_lr 1 without momentum: the outer optimizer holds no state; the outer step leaves every
    replica at the mean of their inner weights, a joiner mid-phase loads them, and a checkpoint
    taken at the outer step gives them back."""
    run, st = plain_stage.run, plain_stage
    assert (run.averaging.outer_lr, run.averaging.outer_momentum) == (1.0, 0.0)
    a, b, start, ga, gb, half = two_replicas(st)
    for _ in range(H):
        take_step([a, b], [ga, gb], half)
    assert a.last_step["group"] == b.last_step["group"] == 2, (a.last_step, b.last_step)
    inner_a = inner_phase(run, start, [ga] * H, 0)
    inner_b = inner_phase(run, start, [gb] * H, 0)
    for got, x, y in zip(weights(a.module), inner_a, inner_b, strict=True):
        assert torch.allclose(got, (x + y) / 2, atol=1e-6), (got - (x + y) / 2).abs().max()
    assert all(torch.equal(x, y) for x, y in zip(weights(a.module), weights(b.module), strict=True))
    assert not a.outer_optimizer.state, "an outer SGD without momentum keeps no state"
    outer = weights(a.held)

    saved = write_checkpoint(tmp_path, run, 1, Snapshot.take(a.module, a.optimizer, a.epoch, a.outer_optimizer))
    take_step([a, b], [ga, gb], half)  # an inner step of the next phase: a's weights move off the outer ones
    c = st.replica(st.node(stage=1))  # a joiner mid-phase
    assert c.epoch == H + 1
    assert all(torch.equal(x, y) for x, y in zip(weights(c.module), outer, strict=True)), "not the outer weights"
    a.load_checkpoint(check_checkpoint(saved, run, 1))
    assert a.epoch == H
    assert all(torch.equal(x, y) for x, y in zip(weights(a.held), outer, strict=True))


def test_a_joiner_mid_phase_takes_the_outer_weights_and_momentum_and_ends_the_next_phase_equal(processes, stage_one):
    run, st = stage_one.run, stage_one
    a = st.replica(st.node(stage=1))
    b = st.replica(st.node(stage=1))
    half = run.training.global_batch // 2
    for step in range(H + 1):  # one whole phase, and one inner step of the next
        take_step([a, b], [gradient(run, 10 + step), gradient(run, 20 + step)], half)
    outer = weights(a.held)
    assert any(not torch.equal(x, y) for x, y in zip(weights(a.module), outer, strict=True))

    c = st.replica(st.node(stage=1))  # loads the stage's state as a peer starting does
    assert c.epoch == H + 1
    assert all(torch.equal(x, y) for x, y in zip(weights(c.module), outer, strict=True)), "not the outer weights"
    momentum = [c.opt.state_averager.optimizer.state[p]["momentum_buffer"] for p in c.held.parameters()]
    theirs = [a.opt.state_averager.optimizer.state[p]["momentum_buffer"] for p in a.held.parameters()]
    assert all(torch.equal(x, y) for x, y in zip(momentum, theirs, strict=True)) and theirs[0].abs().sum() > 0

    third = run.training.global_batch // 3 + 1  # three replicas fill the global batch
    while a.epoch % H:
        take_step([a, b, c], [gradient(run, 30 + a.epoch + k) for k in range(3)], third)
    assert a.last_step["group"] == 3, a.last_step
    for x, y, z in zip(weights(a.module), weights(b.module), weights(c.module), strict=True):
        assert torch.equal(x, y) and torch.equal(x, z)


def test_a_replica_whose_partner_left_mid_phase_keeps_its_own_inner_progress(processes, stage_one):
    run = stage_one.run
    a, b, start, ga, gb, half = two_replicas(stage_one)
    take_step([a, b], [ga, gb], half)
    b.close()
    stage_one.replicas.remove(b)
    started = time.monotonic()
    for _ in range(H - 1):  # the trainers now send a the whole batch; its mean gradient stays ga
        take_step([a], [ga], run.training.global_batch)
    assert time.monotonic() - started < ROUND_S  # it never waited a round out for b
    assert_outer_step_alone(a, start, ga)


def follow_the_stage(b: SwarmUpdater) -> None:
    """As b's stepper does once its tracker sees the stage a step ahead and b has nothing of its own to
    step: move on to the stage's step, keeping its inner progress."""
    deadline = time.monotonic() + 30
    while not b.behind(0):
        assert time.monotonic() < deadline, "b never saw the stage ahead"
        time.sleep(0.05)
    assert "same outer weights" in b.load_state()


def outer_step_together(a: SwarmUpdater, b: SwarmUpdater) -> None:
    """The phase's outer step, a holding the whole batch and b none of it: both average, in one group."""
    full = a.run.training.global_batch
    wait_ready(a, full)
    wait_ready(b, 0)
    deadline = time.monotonic() + ROUND_S

    def outer_step_with_nothing_served() -> None:
        while b.epoch < H:  # a step with no samples of its own takes place and returns 0
            assert time.monotonic() < deadline, "b never took the outer step"
            b.step(0)
            time.sleep(0.05)

    with ThreadPoolExecutor(2) as pool:
        stepped = [pool.submit(step_until_taken, a, full, ROUND_S), pool.submit(outer_step_with_nothing_served)]
        assert stepped[0].result() == full and stepped[1].result() is None
    assert a.last_step["group"] == b.last_step["group"] == 2, (a.last_step, b.last_step)
    assert a.last_step["reduced_bytes"] > 0
    for x, y in zip(weights(a.module), weights(b.module), strict=True):
        assert torch.equal(x, y), "the replicas left the outer step apart"


def test_an_outer_step_waits_for_a_live_replica_one_step_behind(processes, stage_one):
    """A replica that served none of a step's samples lags the stage by that step until it sees the stage
    ahead (its stepper then moves it on, keeping its inner progress). An outer step taken meanwhile by
    a replica that served the whole batch must wait for it: its phase belongs in the average."""
    run = stage_one.run
    a, b, _, ga, gb, half = two_replicas(stage_one)
    full = run.training.global_batch
    for _ in range(H - 2):
        take_step([a, b], [ga, gb], half)
    serve(a, ga, full)  # the phase's last inner step: the trainers send a the whole batch
    wait_ready(a, full)
    assert step_until_taken(a, full, ROUND_S) == full
    assert (a.epoch, b.epoch) == (H - 1, H - 2)

    serve(a, ga, full)  # the outer step's batch, all on a again, before b has moved on
    see_each_other([a, b])
    time.sleep(1.0)  # every read a's readiness makes is past the reports above
    assert not a.ready(full), "the outer step did not wait for a live replica of the stage one step behind"

    follow_the_stage(b)
    assert b.epoch == H - 1
    outer_step_together(a, b)


def test_a_dht_member_outside_the_stage_cannot_hold_up_an_outer_step_with_a_lagging_report(processes, stage_one):
    """An outer step waits for a live replica of the stage that reports an earlier step of the phase.
    A DHT member that serves no stage stores such a report in the stage's progress key, signed with
    its own key as hivemind's tracker signs one, and answers every ping: the outer step does not wait
    for it (only the stage's members count), and both replicas take it together."""
    run = stage_one.run
    a, b, _, ga, gb, half = two_replicas(stage_one)
    full = run.training.global_batch
    for _ in range(H - 1):
        take_step([a, b], [ga, gb], half)
    attacker = stage_one.node()
    lagging = dict(
        peer_id=attacker.peer_id.to_bytes(),
        epoch=H - 2,
        samples_accumulated=0,
        samples_per_second=1.0,
        time=get_dht_time(),
        client_mode=False,
    )
    key = f"{averaging_prefix(run.run_id, 1)}_progress"
    assert attacker.store(key, lagging, get_dht_time() + TTL_S, subkey=attacker.record_owner.encode())
    serve(a, ga, full)  # the outer step's batch, all on a
    see_each_other([a, b])
    deadline = time.monotonic() + 10
    while (attacker.peer_id.to_base58(), H - 2, 0) not in a.reports:
        assert time.monotonic() < deadline, "a's tracker never fetched the report"
        time.sleep(0.1)
    # Counted, the report would hold the step until it expires (TTL_S after it was stored); a loaded
    # machine may take a moment to fetch b's latest report and the count.
    deadline = time.monotonic() + TTL_S / 2
    while not a.ready(full):
        assert time.monotonic() < deadline, "a report of a node outside the stage held the outer step up"
        time.sleep(0.1)
    assert (attacker.peer_id.to_base58(), H - 2, 0) in a.reports, "the report was gone: nothing was tested"
    outer_step_together(a, b)


def test_a_replica_that_served_nothing_for_longer_than_a_report_lives_takes_part_in_the_outer_step(
    processes, stage_one, monkeypatch
):
    """hivemind stops reporting the progress of a peer that serves no samples; once its last report
    expired, the stage counted one peer, and the outer step averaged the replica that served alone. A
    replica that follows the stage's steps without serving holds a phase of inner steps all the same.
    The reports live REPORT_TTL_S here, half of a run's TTL_S (read as each replica is made): the test
    waits for one to expire."""
    monkeypatch.setattr(stage_optimizer, "TTL_S", REPORT_TTL_S)
    run = stage_one.run
    a, b, _, ga, gb, half = two_replicas(stage_one)
    full = run.training.global_batch
    take_step([a, b], [ga, gb], half)  # b's last samples
    silent = time.monotonic()
    for _ in range(H - 2):  # the rest of the phase's inner steps: a serves the whole batch, b follows
        serve(a, ga, full)
        wait_ready(a, full)
        assert step_until_taken(a, full, ROUND_S) == full
        time.sleep(REPORT_TTL_S / 2 + 1)
        follow_the_stage(b)
        assert b.epoch == a.epoch
    time.sleep(max(0.0, silent + REPORT_TTL_S + 1 - time.monotonic()))  # b's report from its last samples expired

    serve(a, ga, full)  # the outer step, all on a
    outer_step_together(a, b)


def test_a_replica_left_out_of_a_rounds_count_counts_again_once_it_reports_a_later_step(processes, stage_one):
    """A replica left out of a round's count because it missed a ping (a loaded machine) and then
    reports a later step counts again: the other replica, following the stage without serving, sees
    the stage ahead and catches up. Left out until b's own next step, a stayed hidden from b for good:
    a replica that only follows takes no step of its own (on the code before, b never saw a's step)."""
    run = stage_one.run
    a, b, _, ga, gb, half = two_replicas(stage_one)
    full = run.training.global_batch
    take_step([a, b], [ga, gb], half)
    # As b's round of that step does when a's ping goes unanswered (peer/rounds.py StepRound).
    b.tracker_view.leave_out({a.opt.dht.peer_id.to_bytes()}, b.epoch - 1)
    serve(a, ga, full)  # the next step's batch, all on a
    wait_ready(a, full)
    assert step_until_taken(a, full, ROUND_S) == full
    follow_the_stage(b)
    assert b.epoch == a.epoch == 2


def assert_outer_step_alone(a: SwarmUpdater, start: list[torch.Tensor], ga: list[torch.Tensor]) -> None:
    """`a` ended the phase with an outer step on its own pseudo-gradient alone: nothing of its phase was
    lost, nothing of its departed partner's half phase came in."""
    run = a.run
    assert a.epoch == H and a.last_step["group"] == 1, a.last_step
    inner_a = inner_phase(run, start, [ga] * H, 0)
    av = run.averaging
    for got, s, x in zip(weights(a.module), start, inner_a, strict=True):
        expected = s - av.outer_lr * (1 + av.outer_momentum) * (s - x)
        assert torch.allclose(got, expected, atol=1e-6), (got - expected).abs().max()


# Replica b of stage 1 in a process of its own, so that it can be killed outright (its DHT node and
# p2pd too, with the process group): joined to the DHT at argv[2:], it takes the stage's first inner step
# on half the global batch when told (a line on stdin), then idles until killed.
KILLED_PARTNER = """
import sys, time
from hivemind.utils.crypto import RSAPrivateKey
from peer.averaging import SwarmUpdater
from swarm.config import load_config
from swarm.model import Stage
from swarm.records import PeerRecord, announce_peer, make_dht
from tests.test_diloco import gradient, serve, wait_ready
run = load_config(sys.argv[1])
dht = make_dht(sys.argv[2:], record_key=RSAPrivateKey())
record = PeerRecord(peer_id=dht.peer_id.to_base58(), stage=1, address="127.0.0.1:1", state="online")
assert announce_peer(dht, run.run_id, record, ttl=600, timeout=30)
b = SwarmUpdater(run, 1, Stage(run, 1), dht)
b.load_state()
print("ready", flush=True)
sys.stdin.readline()
half = run.training.global_batch // 2
serve(b, gradient(run, 2), half)
wait_ready(b, half)
assert b.step(half) == half
print("stepped", b.epoch, flush=True)
time.sleep(600)
"""


def test_a_replica_whose_partner_was_killed_mid_phase_keeps_its_own_inner_progress(processes, stage_one, tmp_path):
    """As above, but the partner is SIGKILLed with its DHT node: it leaves no word, and its records and
    progress report stay in the DHT until they expire."""
    run = stage_one.run
    a = stage_one.replica(stage_one.node(stage=1))
    start, ga, half = weights(a.module), gradient(run, 1), run.training.global_batch // 2
    config = tmp_path / "run.toml"
    args = [sys.executable, "-c", KILLED_PARTNER, str(config), *visible_maddrs(a.opt.dht)]
    b = subprocess.Popen(
        args, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert b.stdout.readline().strip() == "ready"
        b.stdin.write("step\n")
        b.stdin.flush()
        serve(a, ga, half)  # the first step of the phase, on half the global batch each
        wait_ready(a, half)
        assert a.step(half) == half and a.epoch == 1
        assert b.stdout.readline().split() == ["stepped", "1"]
        os.killpg(b.pid, signal.SIGKILL)  # mid phase: one inner step of H taken
        b.wait()
        started = time.monotonic()
        for _ in range(H - 1):
            take_step([a], [ga], run.training.global_batch)
        assert time.monotonic() - started < ROUND_S  # it never waited a round out for the dead partner
        assert_outer_step_alone(a, start, ga)
    finally:
        if b.poll() is None:
            os.killpg(b.pid, signal.SIGKILL)
            b.wait()
