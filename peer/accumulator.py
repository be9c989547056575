"""How a stage worker adds the gradients of the work it serves to the stage's, and takes one back.

A batch's gradient goes to fresh buffers first (peer/pending.py `StagedGrads`) and is kept only for
callers that still wait: one who gave up while it ran has retried elsewhere, and counting its
microbatch here too would count it twice. A gradient that is not finite is never kept.

A training call's gradient can be taken back by its caller until the stage steps with it (`retract`):
the trainer's spot checks outvoted its answer. It is computed again, negated, from the request kept
for that.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from concurrent.futures import Future

import grpc

from peer.compute import StageCompute
from peer.contribution import grads_finite
from peer.options import Faults
from peer.pending import StagedGrads
from peer.queue import Task, gave_up, resolve
from peer.requests import BackwardWork, ForwardWork, RequestError
from peer.stepper import Stepper
from swarm.config import RunConfig

log = logging.getLogger(__name__)


class Accumulator:
    """Adds served work's gradients to the stage's, exactly once per microbatch whose caller still
    waits, and tells the `Stepper` the samples they hold; takes one back on its caller's word. Every
    call runs under the lock that guards the weights (no step runs while it is held: the step's own
    work runs under the step's hold)."""

    def __init__(self, run: RunConfig, compute: StageCompute, stepper: Stepper, faults: Faults):
        self.compute, self.stepper, self.faults = compute, stepper, faults
        # The requests of the gradients kept lately, by microbatch id, for `retract` (the newest last).
        self.retractable: collections.OrderedDict[str, ForwardWork | BackwardWork] = collections.OrderedDict()
        self.retractable_size = max(16, 4 * run.training.accumulation)

    def retract(self, microbatch_id: str, caller: str) -> int:
        """Take back the gradient that `caller`'s training call of `microbatch_id` added here, while the
        stage has not stepped with it; the samples it held. Raises `RequestError` when it cannot."""
        work = self.retractable.get(microbatch_id)
        if work is None:
            raise RequestError(
                grpc.StatusCode.NOT_FOUND, f"microbatch_id: no gradient of {microbatch_id!r} is kept here"
            )
        if work.caller != caller:
            raise RequestError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"microbatch_id: only the caller that sent {microbatch_id!r} may take back its gradient",
            )
        del self.retractable[microbatch_id]
        if microbatch_id not in self.stepper.pending_ids:
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"microbatch_id: the gradient of {microbatch_id!r} is no longer pending here "
                f"(the stage is at step {self.stepper.optimizer_steps})",
            )
        if isinstance(work, BackwardWork):
            negated = dataclasses.replace(work, output_grad=-work.output_grad)
        else:
            negated = dataclasses.replace(work, loss_scale=-work.loss_scale)
        task = Task(0, 0, negated, Future())
        staged = StagedGrads(self.compute.stage)
        try:
            self.compute.backward([task]) if isinstance(work, BackwardWork) else self.compute.forward_loss([task])
        except BaseException:
            staged.drop()
            raise
        staged.commit()
        self.stepper.unserve(microbatch_id, task.samples)
        return task.samples

    def accumulate(self, kind: str, batch: list[Task]) -> tuple[list[Task], list]:
        """Run work that adds to the stage's gradient (backward; the last stage's training forward)
        and keep its gradient only for callers that still wait: those who gave up while it ran (the
        process was frozen, the call timed out or was cancelled) have retried elsewhere, and counting
        their microbatch here too would count it twice. The batch's gradient goes to fresh buffers
        first (`StagedGrads`); when some callers left, it is dropped and the rest is run again.

        A gradient that is not finite is dropped too, and its samples not counted: counted, they
        would complete the stage's global batch early, and the step would average fewer samples than
        it says. Its callers get an error and retry on another peer (one of a batch is run again alone
        first: another's gradient may be the one to blame). Returns the tasks kept and their results."""
        while batch:
            staged = StagedGrads(self.compute.stage)
            try:
                results = self.compute.backward(batch) if kind == "backward" else self.compute.forward_loss(batch)
                self.faults.spoil(self.compute.stage)
                # A slower device's stand-in takes its time before the commit, as the compute would.
                self.faults.delay(sum(t.samples for t in batch))
            except BaseException:
                staged.drop()
                raise
            if not grads_finite(self.compute.stage):
                staged.drop()
                return self._non_finite(kind, batch)
            # The commit point, under the lock that commits: each caller must still wait now, and is
            # then promised its answer (`Task.claim`).
            left = [not task.claim() for task in batch]
            if not any(left):
                if self.stepper.stepping is not None:
                    staged.set_aside(self.stepper.stepping)  # for the step after the one that waits
                else:
                    staged.commit()
                served = [t for t, r in zip(batch, results, strict=True) if not isinstance(r, Exception)]
                self.stepper.served([t.work.microbatch_id for t in served], sum(t.samples for t in served))
                self._keep_for_retract(served)
                return batch, results
            staged.drop()
            for task, gone in zip(batch, left, strict=True):
                if gone:
                    gave_up(task)
            batch = [task.uncached() for task, gone in zip(batch, left, strict=True) if not gone]
        return [], []

    def _keep_for_retract(self, served: list[Task]) -> None:
        """Keep what `retract` needs to compute these tasks' gradients again: their requests, from the
        input alone (a recorded graph is spent). Under the lock."""
        for task in served:
            self.retractable[task.work.microbatch_id] = task.uncached().work
            self.retractable.move_to_end(task.work.microbatch_id)
        while len(self.retractable) > self.retractable_size:
            self.retractable.popitem(last=False)

    def _non_finite(self, kind: str, batch: list[Task]) -> tuple[list[Task], list]:
        """A batch whose gradient came out NaN or Inf: each of several is run again alone; one alone is refused."""
        if len(batch) > 1:
            kept, results = [], []
            for task in batch:
                k, r = self.accumulate(kind, [task.uncached()])
                kept += k
                results += r
            return kept, results
        log.warning(f"stage {self.compute.stage_index}: dropped a non-finite gradient of {batch[0].samples} samples")
        # ABORTED, not INTERNAL (a fault of this server): the input may be what overflowed (a finite
        # 1e37 does) as well as this peer's weights, and either way the caller may ask another peer.
        why = "the gradient came out NaN or Inf (this input on this peer's weights); it was not kept"
        err = RequestError(grpc.StatusCode.ABORTED, why)
        resolve(batch[0].future, error=err)
        return [], []
