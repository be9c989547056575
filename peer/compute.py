"""One stage's module on one device, computing batches of work: forwards, backwards, and the answers
to spot checks.

A spot check's answer (`check`: a last-stage forward's loss and input gradient, a backward's input
gradient) is computed as a training call's would be, and keeps no gradient. A training forward keeps
its graph for its backward (peer/graphs.py), but for a batch of evaluation forwards; a backward runs
on that graph when it is still usable, and recomputes the forward from its input otherwise.

This is the module's side of a stage worker (as hivemind's `ModuleBackend` is a server's): no queue,
no thread; the worker (peer/worker.py) runs it on its compute thread, under the lock that guards the
weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from peer.graphs import RecordedGraphs
from peer.options import Faults
from peer.queue import Task
from peer.requests import CachedForward, ForwardWork
from swarm.config import RunConfig
from swarm.device import autocast


@dataclass
class ForwardResult:
    output: torch.Tensor | None = None
    loss: float = 0.0
    input_grad: torch.Tensor | None = None


class StageCompute:
    """Computes one stage's batches of work on one device: each batch's forward outputs, losses and
    input gradients; a training call's weight gradients accumulate in the stage's `.grad`."""

    def __init__(
        self,
        run: RunConfig,
        stage_index: int,
        stage: torch.nn.Module,
        device: torch.device,
        graphs: RecordedGraphs,
        stepping: Callable[[], bool],
        faults: Faults,
    ):
        """`graphs`: where training forwards keep their graph for the backward; `stepping()`: the
        stage's step is under way (its weights are about to change); `faults`: what a test makes this
        worker do wrong (peer/options.py)."""
        self.run, self.stage_index, self.stage, self.device = run, stage_index, stage, device
        self.graphs, self.stepping, self.faults = graphs, stepping, faults
        self.recomputed = 0  # samples whose training backward ran their forward again (no graph of it kept)
        self.stale_backwards = 0  # samples whose backward ran on a graph recorded before a step (delayed)

    def _lies(self, batch: list[Task]) -> list[bool]:
        """Which samples of the batch a test's dishonest peer corrupts (peer/options.py Faults)."""
        lying = self.faults.lies(self.run, self.stage_index, [t.work for t in batch])
        return [lie for task, lie in zip(batch, lying, strict=True) for _ in range(task.samples)]

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def _inputs(self, batch: list[Task]) -> torch.Tensor:
        """The batch's inputs, concatenated, on the device (float32 hidden states, or token ids)."""
        x = torch.cat([t.work.inputs for t in batch]) if len(batch) > 1 else batch[0].work.inputs
        x = self._to_device(x)
        # Detached: a leaf of its own for the input gradient, whatever the caller's tensor carries.
        return x if self.stage.is_first else x.float().detach()

    def _split(self, t: torch.Tensor | None, batch: list[Task]) -> list[torch.Tensor | None]:
        if t is None:
            return [None] * len(batch)
        return list(t.detach().to("cpu").split([task.samples for task in batch]))

    def forward(self, batch: list[Task]) -> list[ForwardResult]:
        first: ForwardWork = batch[0].work
        if first.targets is not None:
            return self.forward_loss(batch)
        # Not while a step waits, but for a delayed trainer: the graph would be of the weights the
        # step is about to change, kept for delayed trainers' graphs only (`WeightsAt`).
        if first.train and self.graphs.cache.size > 0 and (not self.stepping() or self._keeps(first)):
            # Training forwards that came together are run one by one, each recording a graph of its
            # own: their backwards come one at a time, and a graph of the batch could only be spent
            # whole. A backward that recomputes runs the forward again, with grad; on a first stage
            # of small.toml on 2 cores that was a quarter of its compute, more than batching saves.
            return [self._recorded_forward(task) for task in batch]
        x = self._inputs(batch)
        with torch.no_grad(), autocast(self.device, self.run.model.dtype):
            out = self.faults.corrupt(self.stage(x), self._lies(batch))
        return [ForwardResult(output=o) for o in self._split(out, batch)]

    def _keeps(self, work: ForwardWork) -> bool:
        """A delayed trainer's forward whose graph can outlive the stage's step: the step copies the
        weights first. Not with activation checkpointing: backward would recompute the blocks on the
        weights of the moment."""
        return work.delayed and not self.run.model.checkpoint_activations

    def _recorded_forward(self, task: Task) -> ForwardResult:
        """A training forward whose graph is kept for its backward (`RecordedGraphs.claim`)."""
        x = self._inputs([task])
        weights, keeps = self.graphs.weights, self._keeps(task.work)
        # Only a delayed trainer's graph may be used once the weights changed: only its saved weights are watched.
        watch = weights.hooks() if keeps else contextlib.nullcontext()
        with torch.enable_grad(), autocast(self.device, self.run.model.dtype), watch:
            if not self.stage.is_first:
                x.requires_grad_(True)
            out = self.faults.corrupt(self.stage(x), self._lies([task]))
        entry = CachedForward(x, out, self.graphs.version, weights, keeps)
        if keeps and self.stepping():
            weights.keep()  # the step that waits copied none: there was no such graph when it began
        self.graphs.cache.put(task.work.microbatch_id, entry)
        return ForwardResult(output=out.detach().to("cpu"))

    def forward_loss(self, batch: list[Task]) -> list[ForwardResult]:
        """Last stage with targets: the loss of each request and, when training, its input gradient;
        a spot check's (`check`) gets the same answer and keeps no gradient."""
        train, check = batch[0].work.train, batch[0].work.check
        x = self._inputs(batch)
        targets = self._to_device(torch.cat([t.work.targets for t in batch]))
        input_grad = (train or check) and not self.stage.is_first
        with torch.set_grad_enabled(train or input_grad):
            if input_grad:
                x.requires_grad_(True)
            with autocast(self.device, self.run.model.dtype):
                logits = self.faults.corrupt(self.stage(x), self._lies(batch))
            per_sample = F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none").mean(dim=1)
            sizes = [t.work.inputs.shape[0] for t in batch]
            losses = [chunk.mean() for chunk in per_sample.split(sizes)]
            if train or input_grad:
                total = sum(loss * t.work.loss_scale for loss, t in zip(losses, batch, strict=True))
                if train:
                    total.backward()
                else:
                    (x.grad,) = torch.autograd.grad(total, x)
        grads = self._split(x.grad if input_grad else None, batch)
        return [ForwardResult(loss=float(loss.detach()), input_grad=g) for loss, g in zip(losses, grads, strict=True)]

    def backward(self, batch: list[Task]) -> list[torch.Tensor | None | Exception]:
        """Each task's input gradient; the weights' gradients accumulate, but for a spot check's (`check`)."""
        if batch[0].work.check:
            return self._input_grads(batch)
        results: list[torch.Tensor | None | Exception] = [None] * len(batch)
        recompute = []
        for i, task in enumerate(batch):
            cached = task.work.cached
            if cached is None or not self.graphs.usable(cached):
                # A forward recorded before the stage's last step (another trainer's samples completed
                # a global batch in between) is recomputed on the weights the stage has now, as one
                # served by another peer is; a delayed trainer's runs on the weights it was recorded on.
                recompute.append(i)
            else:
                if cached.version != self.graphs.version:
                    self.stale_backwards += task.samples
                cached.output.backward(self._to_device(task.work.output_grad).to(cached.output.dtype))
                results[i] = None if self.stage.is_first else cached.inputs.grad.detach().to("cpu")
        if recompute:
            sub = [batch[i].uncached() for i in recompute]
            self.recomputed += sum(t.samples for t in sub)
            x = self._inputs(sub)
            grad = self._to_device(torch.cat([t.work.output_grad for t in sub]))
            with torch.enable_grad():
                if not self.stage.is_first:
                    x.requires_grad_(True)
                with autocast(self.device, self.run.model.dtype):
                    out = self.stage(x)
                out.backward(grad.to(out.dtype))
            grads = self._split(None if self.stage.is_first else x.grad, sub)
            for i, g in zip(recompute, grads, strict=True):
                results[i] = g
        return results

    def _input_grads(self, batch: list[Task]) -> list[torch.Tensor | None]:
        """A spot check's backward: the input gradient each task's training backward would give, and
        no gradient of the weights."""
        if self.stage.is_first:
            return [None] * len(batch)  # token ids have no gradient: nothing to compare
        results = []
        for task in batch:
            cached = task.work.cached
            if cached is not None and cached.version == self.graphs.version:
                x, out = cached.inputs, cached.output
            else:
                x = self._inputs([task.uncached()]).requires_grad_(True)
                with torch.enable_grad(), autocast(self.device, self.run.model.dtype):
                    out = self.stage(x)
            grad = self._to_device(task.work.output_grad).to(out.dtype)
            (g,) = torch.autograd.grad(out, x, grad)
            results.append(g.detach().to("cpu"))
        return results
