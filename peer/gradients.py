"""Synchronous gradient averaging (`[averaging] mode = "gradients"`, `GradientUpdater`): at every step
the replicas of a stage all-reduce their gradients, each weighted by the samples it served, and every
replica applies the same averaged gradient with the same AdamW state and learning rate, as in
synchronous data parallelism. What goes in is guarded: each contribution is clipped
(`clip_contribution`, peer/contribution.py), and the step clips the averaged gradient again by the
norm over the whole model (peer/norm_exchange.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from peer.averaging import SwarmUpdater
from peer.contribution import clip_contribution, scale_grads
from swarm.optim import make_optimizer, param_groups, primed
from swarm.schedule import lr_at

log = logging.getLogger("swarm.averaging")


class GradientUpdater(SwarmUpdater):
    """The peers of one stage average gradients to a global batch through hivemind.Optimizer; the
    module's weights are the ones hivemind averages and hands to joiners."""

    outer_optimizer = None

    def _hivemind_params(self) -> tuple[list[dict], Callable, Callable | None]:
        t, run = self.run.training, self.run
        self.held = self.module
        self.clipped = 0  # contributions clipped to `contribution_bound` before they were averaged
        self.contribution_bound = run.averaging.contribution_clip * t.grad_clip
        optimizer = lambda groups: primed(make_optimizer(groups, run, global_norm=self.norms))  # noqa: E731
        # hivemind steps the scheduler once per epoch: the rate of global step e is lr_at(e).
        scheduler = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda e: lr_at(e, t) / t.lr)  # noqa: E731
        return param_groups(self.module, t.weight_decay), optimizer, scheduler

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer of the module's weights."""
        return self.opt.state_averager.optimizer

    @property
    def agreed_step(self) -> int:
        return self.epoch

    def agreed_weights(self) -> None:
        """None: the module's weights are the stage's."""
        return None

    def step(self, pending: int, force: bool = False) -> int:
        """Hand this peer's gradient to the stage's all-reduce and apply the average; returns the
        samples used (0 when no step was taken). `force`: end the epoch even if the count falls short
        (the trainer has moved on)."""
        pending = self._finite(self.held, pending)
        scale = 1.0  # applied to .grad for the all-reduce; undone when no step is taken
        if pending > 0:
            # .grad holds (pending / global batch) x this peer's mean gradient; hivemind averages
            # contributions weighted by their samples, so hand it the mean, clipped.
            scale = self.run.training.global_batch / pending
            scale_grads(self.held, scale)
            clipped = clip_contribution(self.held, self.contribution_bound)
            if clipped < 1.0:
                scale *= clipped
                self.clipped += 1
                log.info("stage %d step %d: clipped this peer's gradient by %.3g", self.stage, self.epoch, clipped)
        return self._average(pending, force, scale)
