"""When a stage worker takes its optimizer steps, and what it keeps track of between them.

The worker accumulates the gradients of the samples it served in the parameters' `.grad`; an
`Updater` turns them into a step: alone (`LocalUpdater`, peer/local_updater.py, every global batch) or
averaged with the other peers of the stage (`SwarmUpdater`, peer/averaging.py). The `Stepper` decides when:

A stage steps every global batch of samples it served, from whichever trainers sent them (as
hivemind counts a collaboration's samples). Every answer tells the trainer the stage's step
(`stage_step`): the steps it took, plus one when the samples it served complete the next global
batch (that step is taken before any later work). A trainer names in its next requests the step
all stages reached (swarm/trainer/loop.py): one trainer alone names s + 1 after its step s, so each
of its global batches is one step, as in synchronous training; with several trainers the stages
count every one's samples, and no trainer waits for a step that the others' samples complete.

Requests carry the global step whose weights they need: a training request for step s needs the
weights after s steps, so a worker that has not yet taken step s - 1 finishes it first (waiting for
the stage's count, at most `averaging.sync_timeout_s`). A worker that missed steps takes the stage's
state from its live peers (`resync`); steps whose gradients died with the peers that served them
are skipped, so that the stage's step count stays the swarm's global step. Neither is taken on one
caller's word: work naming a step beyond one past both the replica's own step and what a majority
of the swarm's machines announce is refused (`reachable`, swarm/steps.py), and requests make a
replica download the stage's state at most once per step of its own.

The stages' steps line up by count: a batch of work that adds to the gradient stops at the global
batch (`room`), so that every stage's step n holds the n-th global batch of the samples it served.
The stages exchange gradient norms by step number (peer/norm_exchange.py NormExchange): were stage 1's
step n to swallow two trainers' batches at once, stage 0's step n would wait for a norm that only
comes after work stage 0 itself has to serve. While a step waits for the other stages' norms (the
last stage finishes its batch a whole backward pass before the first), the compute thread serves
queued training work (`stepping`, worker.py `_serve_aside`), up to one global batch: work for the
steps already taken (another trainer's), and work for the step being taken, on the weights before
it: a gradient one step stale, as with hivemind's delayed parameter updates. Its gradients are set
aside (`Aside`) and count toward the next step. A forward that adds no gradient
(evaluation, and any training forward of an inner stage: it may be a spot check, and checks look like
training forwards) needs the exact weights it names, being compared with other peers' answers, and
waits for the step. One trainer alone
sends its next requests only after the step's last backward, which the last stage to finish answers
before it steps, so its steps stay those of synchronous training.

Checkpoints (peer/checkpoint.py): right after an optimizer step, on the compute thread and under the
lock that guards the weights, the stepper offers the stage's state to a `CheckpointWriter`, which
copies it when a checkpoint is due and writes it on its own thread.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import grpc
import torch

from peer.averaging import SwarmUpdater
from peer.checkpoint import Checkpoint, CheckpointWriter, Snapshot
from peer.local_updater import LocalUpdater
from peer.pending import Aside, Pending
from peer.requests import RequestError
from swarm.config import RunConfig

log = logging.getLogger(__name__)

ORPHAN_QUIET_S = 1.0  # no gradient work for this long before a step short of its count is taken (`_orphaned`)


class Updater(Protocol):
    """Turns a stage's accumulated gradients into optimizer steps. `pending` is the number of samples
    whose gradients this replica holds since its last step."""

    @property
    def epoch(self) -> int:
        """Global steps the stage's weights include."""

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    @property
    def outer_optimizer(self) -> torch.optim.Optimizer | None:
        """diloco: the outer optimizer (its momentum goes into checkpoints); None otherwise."""

    @property
    def agreed_step(self) -> int:
        """The step of the weights the stage's replicas agree on: `epoch`, or (diloco) the last outer step."""

    def agreed_weights(self) -> list[torch.Tensor] | None:
        """A copy of the weights the stage's replicas agree on, in the order of the module's trainable
        parameters, when the module holds others (diloco, within a phase: its inner weights); None
        when the module's weights are the agreed ones."""

    @property
    def missed(self) -> bool:
        """The last step left this replica out: its state is not the step's."""

    def served(self, pending: int) -> None:
        """Hear that this replica now holds `pending` samples' gradients."""

    def ready(self, pending: int) -> bool:
        """Time to take the step: the stage served its global batch."""

    def orphaned(self, pending: int) -> bool:
        """The stage's count falls short and what it lacks is gone: the other stages finished the step
        and the replicas that served the rest are dead (the step is then taken short, `force`, or with
        nothing when this replica served none of it)."""

    def started(self, pending: int) -> bool:
        """Some replica of the stage served samples toward the current step."""

    def behind(self, pending: int) -> bool:
        """This replica's weights are not the stage's: it must `load_state` before stepping."""

    def settling(self) -> bool:
        """Whether this replica's weights are the stage's is not known yet (its last round left the
        others out): work waits until it is, or the state is loaded."""

    def step(self, pending: int, force: bool = False) -> int:
        """Apply the accumulated gradient (`force`: even short of the global batch); returns the
        samples used (0: no step was taken)."""

    def skip_to(self, step: int) -> None:
        """Count the steps up to `step` as taken, applying nothing (their gradients are gone)."""

    def load_state(self) -> str:
        """Take the stage's current state from its live replicas, if any; returns where it came from."""

    def load_checkpoint(self, checkpoint: Checkpoint) -> str:
        """Take weights, optimizer state and step from `checkpoint`; returns where they came from."""

    def close(self) -> None: ...


def make_updater(
    run: RunConfig,
    stage: int,
    module: torch.nn.Module,
    dht=None,
    idle: Callable[[], None] | None = None,
    declared: Callable[[int], int] = int,
) -> Updater:
    """A lone stage's updater, or with a `dht` one that averages with the other peers of the stage;
    `idle` is called while its step waits for the other stages' gradient norms; `declared(samples)`:
    what it tells the others it holds (a test's hostile peer lies)."""
    if dht is None:
        return LocalUpdater(run, module)
    return SwarmUpdater(run, stage, module, dht, idle=idle, declared=declared)


class StepRecords:
    """What each step leaves behind: a line in the step log (`step_log`, a test's: the microbatches it
    applied) and, when one is due, a checkpoint (`checkpoints`, which saves the stage's state every so
    many steps)."""

    def __init__(
        self,
        stage_index: int,
        module: torch.nn.Module,
        updater: Updater,
        step_log: Path | None = None,
        checkpoints: CheckpointWriter | None = None,
    ):
        self.stage_index, self.module, self.updater = stage_index, module, updater
        self.step_log, self.checkpoints = step_log, checkpoints

    def took(self, step: int, microbatch_ids: list[str]) -> None:
        """The stage took global step `step` (the count of steps its weights include), applying these
        microbatches. On the compute thread, under the lock that guards the weights."""
        if self.step_log:
            entry = {"stage": self.stage_index, "step": step, "microbatches": microbatch_ids}
            # The bytes of the stage's all-reduce this replica reduced for the others (averaging on).
            entry["reduced_bytes"] = getattr(self.updater, "last_step", {}).get("reduced_bytes", 0)
            with open(self.step_log, "a") as f:
                f.write(json.dumps(entry) + "\n")
        if self.checkpoints is not None and not self.updater.missed and self.updater.agreed_step == step:
            # A replica that missed the stage's all-reduce holds a state that is not the step's;
            # within a DiLoCo phase the weights are this replica's own (it is written at the
            # first outer step from the interval on: `CheckpointWriter.offer`).
            self.checkpoints.offer(
                step, lambda: Snapshot.take(self.module, self.updater.optimizer, step, self.updater.outer_optimizer)
            )

    def close(self) -> None:
        """Finish the checkpoint being written."""
        if self.checkpoints is not None:
            self.checkpoints.close()


class Stepper:
    """Keeps one stage's weights at the swarm's global step: counts the samples served, steps,
    catches up, resyncs and skips; logs each step and offers it to the checkpoints."""

    def __init__(
        self,
        run: RunConfig,
        stage_index: int,
        module: torch.nn.Module,
        updater: Updater,
        lock: threading.Lock,
        stopped: Callable[[], bool],
        invalidate: Callable[[], None],
        step_log: Path | None = None,
        checkpoints: CheckpointWriter | None = None,
        before_step: Callable[[], None] = lambda: None,
    ):
        """`lock` guards the weights and gradients (shared with the compute); `stopped` says the worker
        is closing (a catch-up stops waiting); `invalidate` is called when the weights change, so that
        forward graphs recorded before are not used (`before_step`, called under the lock before the
        updater steps, may copy the weights some of them still need); `step_log` gets one JSON line per
        step naming the microbatches it applied; `checkpoints` saves the stage's state every so many steps."""
        self.run, self.stage_index, self.module, self.updater = run, stage_index, module, updater
        self.lock, self.stopped, self.invalidate, self.before_step = lock, stopped, invalidate, before_step
        self.records = StepRecords(stage_index, module, updater, step_log, checkpoints)
        self.pending = Pending(run.training.global_batch, updater.served)
        self.waited_s = 0.0  # time the compute thread spent in catch_up waiting for a step
        self._next_resync = 0.0
        self._resynced_at: int | None = None  # this replica's step when a request last had it resync
        # The step the swarm's other machines announce (swarm/steps.py `others_step`), kept current by
        # the peer's daemon (it lags by a refresh or two); None: no swarm (a stage served by hand).
        self.swarm_step: int | None = None
        self.skipped_steps: list[range] = []  # global steps whose gradients never reached this stage (catch_up)

    @property
    def pending_ids(self) -> list[str]:
        """Microbatches accumulated since the last step."""
        return self.pending.ids

    @property
    def samples_served(self) -> int:
        """Samples whose gradients were accumulated."""
        return self.pending.served

    @property
    def stepping(self) -> Aside | None:
        """While a step runs: the work served meanwhile (`Pending.aside`)."""
        return self.pending.aside

    @property
    def optimizer_steps(self) -> int:
        """Global steps this stage's weights include."""
        return self.updater.epoch

    @property
    def stage_step(self) -> int:
        """The global step this stage reaches with the samples it served: a step due is counted (it is
        taken before any later work: after the answers, or in the next request's catch-up)."""
        aside = self.stepping
        if aside is not None:  # the step being taken counts, and the next once the work set aside fills it
            return aside.step + int(aside.samples >= self.run.training.global_batch)
        return self.optimizer_steps + int(self.updater.ready(self.pending.samples))

    def room(self) -> int:
        """Samples the next batch of gradient work may hold (`Pending.room`)."""
        return self.pending.room()

    def served(self, microbatch_ids: list[str], samples: int) -> None:
        """These microbatches' gradients were accumulated (set aside, while a step runs). Under the lock."""
        self.pending.add(microbatch_ids, samples)

    def unserve(self, microbatch_id: str, samples: int) -> None:
        """This pending microbatch's gradient was taken back (peer/accumulator.py `retract`). Under the lock."""
        self.pending.remove(microbatch_id, samples)

    def load_checkpoint(self, checkpoint: Checkpoint) -> str:
        """Take the stage's weights, optimizer state and step from `checkpoint`; returns the source."""
        with self.lock:
            source = self.updater.load_checkpoint(checkpoint)
            self.invalidate()
        return source

    def reachable(self, step: int) -> int:
        """The furthest step work may take this replica to, for a batch whose furthest work names
        `step`: one past both its own step and what most of the swarm's other machines announce
        (`swarm_step`; its caller's word alone for a stage served by hand). Work that names more is
        refused (`ahead`): nobody's word alone makes a stage skip steps. A replica that is behind (the
        records or its stage's averaging say the stage is ahead) first takes the stage's state, at
        most once per step of its own, so that a trainer's work for the stage's next step is served.
        An honest trainer is refused only by a replica that is behind with nobody to load the state
        from, before the records show its stage's step; it retries on another peer."""
        own, known = self.optimizer_steps, self.swarm_step
        ahead = step > own + 1 and self._resynced_at != own
        if ahead and (known is None or known > own or self.updater.behind(self.pending.samples)):
            self._resynced_at = own
            self.resync()
        return step if known is None else max(self.optimizer_steps, known) + 1

    def ahead(self, step: int) -> RequestError:
        """The refusal of work for `step`, beyond `reachable`."""
        return RequestError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"step: {step} is ahead of the swarm: a majority of its machines announce step {self.swarm_step}, "
            f"this stage is at step {self.optimizer_steps}",
        )

    def catch_up(self, step: int) -> None:
        """Work for global step `step` needs the weights after `step` steps: take the step before it
        first, once the stage has served its batch (or the wait for the count times out).

        The stage's step count stays the swarm's global step: a step none of whose samples reached
        a live peer of the stage (the peers that served it died with its gradients) is skipped, not
        left to shift every later step by one (each later step would then wait for a count that never
        comes, and exchange gradient norms with the other stages under the wrong step)."""
        if step > self.optimizer_steps + 1:
            if self._resynced_at != self.optimizer_steps:  # one download per step, whatever the requests say
                self._resynced_at = self.optimizer_steps
                self.resync()  # the peer missed steps: take the stage's state
            if step > self.optimizer_steps + 1:
                # No live peer of the stage is past them, so none holds their gradients either.
                self._skip_to(step, "no live peer of the stage took them")
        start = time.monotonic()
        try:
            # (Work for an older step goes on at once: a stale trainer's gradient counts toward the
            # current step, as in hivemind.)
            if step == self.optimizer_steps + 1:
                self._wait_for(step, start + self.run.averaging.sync_timeout_s)
            self._settle()
        finally:
            self.waited_s += time.monotonic() - start

    def _wait_for(self, step: int, deadline: float) -> None:
        while self.optimizer_steps < step and not self.stopped():
            if self._orphaned():  # (before `behind`: nobody is left to load the state from)
                with self.lock:
                    self._step(force=True)
            elif self.updater.behind(self.pending.samples):
                self.resync()
            elif self.updater.ready(self.pending.samples):
                with self.lock:
                    self._step()
            elif time.monotonic() > deadline:
                if self.updater.started(self.pending.samples):
                    with self.lock:
                        self._step(force=True)
                if self.optimizer_steps < step:
                    self._skip_to(step, "none of its samples reached a live peer of the stage")
                return
            else:
                time.sleep(0.02)

    def _settle(self) -> None:
        """Hold the work while the replica's weights may not be the stage's (`Updater.settling`: its
        last round included none of the others), loading the stage's state if the replicas' digests
        say they are not. Served at once, the work would be computed on weights no other replica holds,
        and the spot checks that compare the replicas' answers would outvote this honest one."""
        while self.updater.settling() and not self.stopped():
            if self.updater.behind(self.pending.samples):
                self.resync()
            time.sleep(0.05)

    def maybe_step(self) -> None:
        """Step when the stage has served its batch; resync (at most every 2 s) when behind."""
        if self._orphaned():  # (before `behind`: nobody is left to load the state from)
            with self.lock:
                self._step(force=True)
        elif self.updater.behind(self.pending.samples):
            if time.monotonic() >= self._next_resync:
                self._next_resync = time.monotonic() + 2
                self.resync()
        elif self.updater.ready(self.pending.samples):
            with self.lock:
                self._step()

    def _orphaned(self) -> bool:
        """The updater says the rest of the step's samples (all of them, when this replica holds none)
        died with other replicas, and no gradient work came for ORPHAN_QUIET_S (a trainer retrying a
        dead replica's call sends it here meanwhile)."""
        quiet = time.monotonic() - self.pending.served_at > ORPHAN_QUIET_S
        if not (quiet and self.updater.orphaned(self.pending.samples)):
            return False
        log.info(
            f"stage {self.stage_index} step {self.optimizer_steps}: the rest of its batch died with the replicas "
            f"that served it; stepping with {self.pending.samples} samples"
        )
        return True

    def resync(self) -> None:
        """Replace this replica's state by the stage's. Gradients served toward the step the stage is
        at are kept (they were computed on weights one step away at most); older ones are dropped."""
        with self.lock:
            before = self.optimizer_steps
            params = [p for p in self.module.parameters() if p.grad is not None]
            kept = [p.grad.clone() for p in params] if self.pending.samples else []
            source = self.updater.load_state()
            self.invalidate()  # the weights were replaced in place: recorded graphs no longer match them
            if kept and self.optimizer_steps == before:
                with torch.no_grad():
                    for p, g in zip(params, kept, strict=True):
                        p.grad.copy_(g)  # hivemind zeroed the buffers when it loaded the state
                self.updater.served(self.pending.samples)
            else:
                self._drop_pending()
        log.info(f"stage {self.stage_index}: caught up to step {self.optimizer_steps} from {source}")

    def close(self) -> None:
        """Leave the stage's averaging and finish the checkpoint being written."""
        self.updater.close()
        self.records.close()

    def _skip_to(self, step: int, why: str) -> None:
        """Take the stage's step count to `step` without applying anything: the gradients of the
        steps in between are gone. Gradients held for an older step are dropped with them."""
        with self.lock:
            skipped = range(self.optimizer_steps, step)
            if not skipped:
                return
            self._drop_pending()
            self.updater.skip_to(step)
            self.skipped_steps.append(skipped)
            self.invalidate()
        steps = str(skipped[0]) if len(skipped) == 1 else f"{skipped[0]}-{skipped[-1]}"
        log.warning(f"stage {self.stage_index}: skipped step(s) {steps}: {why}")

    def _drop_pending(self) -> None:
        """Forget the gradients accumulated since the last step (their step is gone). Under the lock."""
        if self.pending.samples:
            log.info(f"stage {self.stage_index}: dropped {self.pending.samples} samples' gradients")
        self.pending.drop()
        self.module.zero_grad(set_to_none=False)

    def _step(self, force: bool = False) -> None:
        """Take the stage's step, if the updater does. Under the lock (the work served while the step
        waits runs on the step's behalf, under the same hold: `stepping`)."""
        before = self.optimizer_steps
        self.before_step()
        aside = self.pending.set_aside(before + 1)
        try:
            used = self.updater.step(self.pending.samples, force=force)
            if self.optimizer_steps == before:
                return
            self.invalidate()  # graphs recorded before the step no longer match the weights
            self.records.took(self.optimizer_steps, self.pending_ids)
            self.pending.stepped(used)
        finally:
            self.pending.restore(aside)  # what was served while the step ran counts toward the next one
