"""The gradients a stage replica holds toward the stage's steps, and their count.

A batch's gradients go to fresh buffers first (`StagedGrads`) and join the stage's only once kept;
those of work served while a step runs are set aside for the step after it (`Aside`); `Pending`
counts the samples and names the microbatches held toward the next step (peer/stepper.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


class StagedGrads:
    """Sets a module's accumulated gradients aside, so that the next backward fills fresh buffers;
    then `commit` adds those to the ones set aside, or `drop` forgets them. Either way each `.grad`
    is afterwards the tensor it was before (hivemind's averager reads them in place)."""

    def __init__(self, module: torch.nn.Module):
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.kept = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None

    def commit(self) -> None:
        with torch.no_grad():
            for p, kept in zip(self.params, self.kept, strict=True):
                if kept is None:
                    continue  # the fresh buffer (or none) stays
                if p.grad is not None:
                    kept.add_(p.grad)
                p.grad = kept

    def drop(self) -> None:
        for p, kept in zip(self.params, self.kept, strict=True):
            p.grad = kept

    def set_aside(self, aside: Aside) -> None:
        """Add the fresh gradients to `aside` (not to the ones set aside here), and put those back."""
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    aside.add(p, p.grad)
        self.drop()


class Aside:
    """The gradients of work served while the stage's step waits (`Stepper.stepping`): they belong to
    the step after it, so they stay out of the buffers the step reads, until it is taken."""

    def __init__(self, step: int):
        self.step = step  # the global step being taken: the weights are still those before it
        self.grads: dict[torch.nn.Parameter, torch.Tensor] = {}
        self.samples = 0
        self.ids: list[str] = []

    def add(self, p: torch.nn.Parameter, grad: torch.Tensor) -> None:
        if p in self.grads:
            self.grads[p].add_(grad)
        else:
            self.grads[p] = grad.detach().clone()

    def restore(self) -> None:
        """Into the parameters' gradients (which the step left zeroed, or set to None)."""
        with torch.no_grad():
            for p, grad in self.grads.items():
                if p.grad is None:
                    p.grad = grad
                else:
                    p.grad.add_(grad)


class Pending:
    """The samples whose gradients this replica holds toward the stage's next step, and their
    microbatches; while a step runs (`aside`), those served meanwhile, which count toward the step
    after it. `heard(samples)` is told each new count toward the next step (`Updater.served`)."""

    def __init__(self, global_batch: int, heard: Callable[[int], None]):
        self.global_batch, self.heard = global_batch, heard
        self.ids: list[str] = []  # microbatches accumulated since the last step
        self.samples = 0  # ... their samples
        self.served = 0  # samples whose gradients were accumulated
        self.served_at = 0.0  # when gradient work was last served (time.monotonic)
        # While a step runs (it may wait for the other stages' gradient norms), the compute thread
        # serves the work that does not need it; that work's gradients go here (worker.py: _serve_aside).
        self.aside: Aside | None = None

    def room(self) -> int:
        """Samples the next batch of gradient work may hold without crossing the global batch; 0 once
        the batch is full (gradient work then waits for the step, or, while a step waits, for the
        step after it: were one stage's step to hold more than the global batch, the stages' steps
        would no longer hold the same samples, and their gradient norms would wait on each other)."""
        held = self.aside.samples if self.aside is not None else self.samples
        return max(0, self.global_batch - held)

    def add(self, microbatch_ids: list[str], samples: int) -> None:
        """These microbatches' gradients were accumulated (set aside, while a step runs)."""
        self.served += samples
        self.served_at = time.monotonic()
        if self.aside is not None:
            self.aside.samples += samples
            self.aside.ids.extend(microbatch_ids)
            return
        self.samples += samples
        self.ids.extend(microbatch_ids)
        self.heard(self.samples)

    def remove(self, microbatch_id: str, samples: int) -> None:
        """This pending microbatch's gradient was taken back."""
        self.ids.remove(microbatch_id)
        self.served -= samples
        self.samples -= samples
        self.heard(self.samples)

    def drop(self) -> None:
        """Forget the samples toward the next step (their gradients are gone)."""
        self.samples, self.ids = 0, []

    def set_aside(self, step: int) -> Aside:
        """Global step `step` is being taken: what is served from now counts toward the one after it."""
        self.aside = Aside(step)
        return self.aside

    def stepped(self, used: int) -> None:
        """The step took `used` of the samples, and every microbatch toward it."""
        self.samples -= used
        self.ids = []

    def restore(self, aside: Aside) -> None:
        """The step is over: what was served while it ran counts toward the next one."""
        self.aside = None
        aside.restore()
        if aside.samples:
            self.samples += aside.samples
            self.ids.extend(aside.ids)
            self.heard(self.samples)
