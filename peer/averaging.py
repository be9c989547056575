"""How the peers of a stage served by a swarm take their optimizer steps together (`SwarmUpdater`).

hivemind's `Optimizer`, one run id per stage (`{run_id}_stage{k}`), with the run's global batch as its
target batch size. Each peer reports the samples it served through hivemind's progress tracker; when
the stage as a whole has served the global batch, every peer hands what it has to one all-reduce,
weighted by the samples it served, and every replica applies the same average: the replicas stay
identical. The step number is hivemind's epoch, and the learning-rate schedule follows it. A peer
that joins downloads the stage's weights, optimizer state and step from live peers (`load_state`)
before it serves. What the all-reduce averages is the run's `[averaging] mode`: the gradients of each
step (peer/gradients.py `GradientUpdater`), or every `inner_steps` steps the pseudo-gradients of
DiLoCo (peer/diloco.py `DiLoCoUpdater`). This module holds what both share.

Both work on the gradients the worker accumulates in the parameters' `.grad`: the last stage scales
each microbatch's loss by samples / global batch, so after a whole global batch the sum of the
served microbatches' gradients is the batch mean, as in the reference trainer. What goes into the
average is guarded: a peer whose gradient is not finite contributes no samples (its gradient is
dropped, peer/contribution.py), and a step whose averaged gradient is not finite is not applied
(`ClippedAdamW` skips it). After every step and load the replicas compare digests of their weights
(peer/replica_check.py). Both resume from a checkpoint (peer/checkpoint.py, `load_checkpoint`):
weights, optimizer state and step, the step becoming the updater's epoch.

hivemind decides the end of an epoch from its tracker, which may also fire early on an estimated
time of arrival. Here the end of a global batch is known exactly (the trainer starts the next step
only when the last one is complete), so a step is taken only on the sample count, or when the
trainer has moved on (a request for a later step) and the count still falls short after
`averaging.sync_timeout_s` — a peer that died took its share of samples with it.
"""

from __future__ import annotations

import collections
import logging
import statistics
import time
from collections.abc import Callable

import hivemind
import torch
from hivemind.p2p import PeerID

from peer.checkpoint import Checkpoint
from peer.contribution import drop_grads, grads_finite, scale_grads
from peer.hivemind_compat import (
    TrackerView,
    adopt_local_state,
    drop_unbegun_round,
    end_epoch_now,
    offer,
    set_epoch,
    uncount,
)
from peer.norm_exchange import NormExchange
from peer.replica_check import ReplicaCheck, weights_digest
from peer.rounds import StepRound, live_partners
from peer.stage_count import StageCount
from peer.stage_optimizer import shut_down, stage_optimizer
from swarm.config import RunConfig
from swarm.records import averaging_prefix, state_holders_key

log = logging.getLogger("swarm.averaging")


class SwarmUpdater:
    """The peers of one stage average to a global batch through hivemind.Optimizer. `SwarmUpdater(run,
    ...)` makes the updater of the run's `[averaging] mode`, one subclass each."""

    MAX_FAILED_LOADS = 3
    ROUND_HISTORY = 8  # the stall bound follows the median of this many last rounds with partners
    STALL_FACTOR = 5.0
    MIN_REFRESH_S = 0.25  # the most often the tracker fetches the stage's progress (`stage_optimizer`)
    held: torch.nn.Module  # the weights hivemind averages, holds and hands to joiners

    def __new__(cls, run: RunConfig, *args, **kwargs):
        if cls is SwarmUpdater:
            # Imported here: both modules build on this one.
            from peer.diloco import DiLoCoUpdater
            from peer.gradients import GradientUpdater

            cls = DiLoCoUpdater if run.averaging.mode == "diloco" else GradientUpdater
        return super().__new__(cls)

    def __init__(
        self,
        run: RunConfig,
        stage: int,
        module: torch.nn.Module,
        dht: hivemind.DHT,
        idle: Callable[[], None] | None = None,
        declared: Callable[[int], int] = int,
    ):
        """`idle`: called again and again while a step waits for the other stages' gradient norms;
        `declared(samples)`: the count this replica tells the stage it holds (a test's liar lies)."""
        self.run, self.stage, self.module, self.declared = run, stage, module, declared
        self.prefix = averaging_prefix(run.run_id, stage)
        self.dropped = 0  # contributions left out of the average because they were not finite
        self.source = "the seeded init"
        self.missed = False  # the last all-reduce left this replica out
        self.lone = False  # the last round included no other replica, though some were live
        self.alone_at = 0.0  # when `settling` last looked for live partners
        self.failed_loads = 0  # loads in a row that brought nothing new while missed
        self.loaded_at: int | None = None  # the step of the last load of the stage's state
        self.norms = NormExchange(dht, run.run_id, run.stages.count, stage, run.averaging.sync_timeout_s, idle)
        self.check = ReplicaCheck(
            dht,
            run.run_id,
            stage,
            sources=lambda: {PeerID(p).to_base58() for p in self._state_holders()},
            members=lambda: self.norms.members(stage),
        )
        self.last_step: dict = {}
        self.rounds: collections.deque[float] = collections.deque(maxlen=self.ROUND_HISTORY)  # seconds, groups >= 2
        self.opt = stage_optimizer(run, dht, self.prefix, self._hivemind_params(), self.MIN_REFRESH_S)
        self.tracker_view = TrackerView(self.opt.tracker)
        self.count = StageCount(self.opt, run, stage, self.norms)

    def _hivemind_params(self) -> tuple[list[dict], Callable, Callable | None]:
        """Set up `held` and what else the mode steps; returns the parameter groups hivemind averages,
        the optimizer it steps them with, and its learning-rate scheduler (None: none)."""

    @property
    def epoch(self) -> int:
        return self.opt.local_epoch

    def served(self, pending: int) -> None:
        """Tell the stage's tracker how many samples this peer holds gradients for."""
        self.opt.tracker.report_local_progress(self.epoch, self.declared(pending))
        if pending > 0:
            self.tracker_view.wake()

    def ready(self, pending: int) -> bool:
        """Time to take the step: the stage as a whole served the global batch (and hivemind sees the
        peers to average with), or the stage's other peers just took it and this peer holds samples."""
        progress = self.opt.tracker.global_progress
        if pending > 0 and progress.epoch == self.epoch + 1:
            return True
        return self.count.reached(progress, pending) and not self._holds_step()

    def _holds_step(self) -> bool:
        """With the count there, whether the step still waits (for a replica that lags behind)."""
        return False

    def orphaned(self, pending: int) -> bool:
        """The count falls short, and what it lacks died with the stage's other replicas (`StageCount`)."""
        return self.count.orphaned()

    def behind(self, pending: int) -> bool:
        """This replica's weights are not the stage's: it missed a step (served nothing toward it, or
        was away), or its last all-reduce did not include the others. It must load their state: when
        the others are ahead, until it has; when only its weights differ, once per step (a load that
        brought nothing new, say while the others were still mid-step, waits for the next step
        rather than downloading the stage's state again and again)."""
        epoch = self.opt.tracker.global_epoch
        if epoch > self.epoch + 1 or (epoch == self.epoch + 1 and pending == 0):
            return True
        if self.loaded_at == self.epoch:
            return False
        if self.missed:
            return True
        if self.check.diverged(expected=max(2, self.opt.tracker.global_progress.num_peers)):
            self.missed = True
            offer(self.opt.state_averager, self.epoch - 0.5)  # load from the majority
            log.warning(f"stage {self.stage} step {self.epoch}: these weights differ from the other replicas'")
        return self.missed

    def settling(self) -> bool:
        """The last round included no other replica though some were live: until the replicas'
        digests say whether these weights are the stage's (`ReplicaCheck`, at most its WAIT_S after
        the step), work computed on them may be on weights nobody else holds. Once no other replica
        is live (`live_partners`: the partner died mid-round, its report not yet expired), none will
        publish a digest, and these weights are the stage's: waiting out WAIT_S stalled the trainer
        about 5 s after one peer of a 2 x 2 swarm was killed. Looked at most every 0.25 s."""
        if not self.lone or self.check.settled or self.loaded_at == self.epoch:
            return False
        if time.monotonic() - self.alone_at > 0.25:
            self.alone_at = time.monotonic()
            if not live_partners(self.opt):
                self.check.settled = True
                log.info(f"stage {self.stage} step {self.epoch}: no other replica is live; these weights stand")
                return False
        return True

    def started(self, pending: int) -> bool:
        """Some peer of the stage served samples toward the current step."""
        return pending > 0 or self.opt.tracker.global_progress.samples_accumulated > 0

    def _average(self, pending: int, force: bool, scale: float = 1.0) -> int:
        """The all-reduce of `held`'s gradient (`pending` samples' worth) and the step on its average;
        returns the samples used (0 when no step was taken). `scale`: what `held`'s gradient was
        scaled by for the all-reduce, undone when no step is taken."""
        if force and not self.ready(pending):
            end_epoch_now(self.opt.tracker)
        step_round = StepRound(self.opt, self.run, self.stage, self.tracker_view, self.norms.members(self.stage))
        before = self.norms.step = self.epoch
        if not step_round.take(self.declared(pending), self._stall_s()):
            # No step (`uncount`): take back what hivemind counted and the scaling, so that a next try
            # counts these samples once.
            uncount(self.opt, self.declared(pending))
            if scale != 1.0:
                scale_grads(self.held, 1.0 / scale)
            return 0
        self._held_changed()
        group = step_round.group()
        self.last_step = step_round.summary(pending, group)
        if group >= 2:
            self.rounds.append(self.last_step["s"] - self.norms.waited)
        log.info(
            f"stage {self.stage} step {before}: {pending} samples, averaged in a group of {group} "
            f"in {self.last_step['s']:.3f} s (norm wait {self.norms.waited:.3f} s)"
        )
        self.lone = group < 2 and bool(step_round.partners)
        if group == 0:
            # The others applied a step this replica did not: it must load their state.
            self.missed = True
            offer(self.opt.state_averager, self.epoch - 0.5)
            return pending
        if group < 2 and pending < self.run.training.global_batch:
            # A partial gradient: the round failed. The others may have averaged among themselves
            # (then this replica is the minority) or failed alike (each applied its own part: the
            # replicas now disagree evenly). The digests settle it either way: the majority, or on
            # a tie the smallest peer id, keeps its state and the rest load it.
            log.info(f"stage {self.stage} step {before}: averaged alone with {pending} samples")
        self.check.publish(self.epoch, weights_digest(self.held))
        return pending

    def _held_changed(self) -> None:
        """`held` just became the stage's weights of a new step (a step taken, or a load)."""

    def _finite(self, module: torch.nn.Module, pending: int) -> int:
        """The samples `module`'s gradient counts for: `pending`, or 0 when it is not finite (then dropped)."""
        if grads_finite(module):
            return pending
        drop_grads(module)
        self.dropped += 1
        log.warning(f"stage {self.stage} step {self.epoch}: dropped a non-finite gradient of {pending} samples")
        return 0

    def _stall_s(self) -> float | None:
        """The longest this step's all-reduce may run before this replica steps alone: STALL_FACTOR x
        the median of the last rounds with partners, at least one matchmaking plus one chunk timeout
        (hivemind itself leaves out a partner whose part is that late); None (up to hivemind's
        averaging_timeout_s) before three such rounds."""
        if len(self.rounds) < 3:
            return None
        a = self.run.averaging
        return max(self.STALL_FACTOR * statistics.median(self.rounds), a.matchmaking_time_s + a.chunk_timeout_s)

    def skip_to(self, step: int) -> None:
        """Count the steps up to `step` as taken, applying nothing: none of their samples reached a live
        peer of this stage. The learning rate follows the step; the other stages do not wait for this
        one's gradient norm (its share of the skipped steps is 0: it applies nothing)."""
        if step <= self.epoch:
            return
        # Only the last few: the other stages wait for the shares of the steps they are taking now.
        for skipped in range(max(self.epoch, step - NormExchange.SKIPPED_SHARES), step):
            self.norms.publish(skipped, 0.0)
        set_epoch(self.opt, step)
        self.check.publish(self.epoch, weights_digest(self.held))

    def load_state(self) -> str:
        """Take the stage's weights, optimizer state and step from live peers, if there are any;
        returns where the state came from."""
        others = self._state_holders() - {self.opt.dht.peer_id.to_bytes()}
        digest = weights_digest(self.held)
        if others:
            drop_unbegun_round(self.opt)
            self.opt.load_state_from_peers()
            self._held_changed()
            self.loaded_at = self.epoch
            # At step 0 the stage's state is the seeded init, whoever handed it over.
            self.source = f"peers of stage {self.stage} at step {self.epoch}" if self.epoch else "the seeded init"
            if self.missed and weights_digest(self.held) == digest:
                # Nothing came (the others were still mid-step: hivemind refuses a state older than
                # its own): stay marked, and try again, a few times.
                self.failed_loads += 1
                if self.failed_loads < self.MAX_FAILED_LOADS:
                    return self.source
                log.info(f"stage {self.stage} step {self.epoch}: no peer offers a newer state; keeping this one")
        source = self.source
        if not others and self.missed:
            # Told its weights differ, with no other replica to load from (any others are behind home
            # routers): these weights stand until the next step; looking again at once found nobody again.
            self.loaded_at = self.epoch
            source = "these weights: no other replica offers the stage's state"
        self.missed, self.failed_loads = False, 0
        offer(self.opt.state_averager, self.epoch)
        self.check.publish(self.epoch, weights_digest(self.held))
        return source

    def load_checkpoint(self, checkpoint: Checkpoint) -> str:
        """Take weights, optimizer state and step from `checkpoint`, as hivemind's
        `load_state_from_peers` takes them from a peer: the checkpoint's step becomes the local epoch
        (and the learning rate's), the stage's tracker hears of it, and this replica offers its state
        with that priority, so replicas of the stage that are behind load it from here."""
        snapshot = checkpoint.load()
        with self.opt.state_averager.lock_averaged_tensors:
            snapshot.apply(self.module, self.optimizer, self.outer_optimizer)
            self._checkpoint_applied()
        adopt_local_state(self.opt, snapshot.step)
        self.missed, self.failed_loads = False, 0
        self.source = f"checkpoint step {self.epoch}"
        self.check.publish(self.epoch, weights_digest(self.held))
        return self.source

    def _checkpoint_applied(self) -> None:
        """A checkpoint's weights and optimizer state are now the module's and its optimizers'."""

    def _state_holders(self) -> set[bytes]:
        """Peers that offer this stage's state (hivemind's averagers announce themselves in the DHT)."""
        found = self.opt.dht.get(state_holders_key(self.prefix), latest=True)
        return set(found.value) if found is not None and isinstance(found.value, dict) else set()

    def close(self, timeout: float = 3.0) -> None:
        """Say goodbye to the stage's peers and stop the averagers, in at most about `timeout` s (`shut_down`)."""
        shut_down(self.opt, timeout)
