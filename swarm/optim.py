"""The optimizer every trainer of a run uses: AdamW, weight decay on matrices only, clipped."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from swarm.config import RunConfig


def param_groups(module: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only (not on norms), as in nanoGPT and Llama."""
    params = [p for p in module.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def _grads(opt: torch.optim.Optimizer) -> tuple[list[torch.Tensor], float]:
    """The optimizer's gradients and their squared norm (not finite when one of them is not)."""
    grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
    return grads, float(torch.stack(torch._foreach_norm(grads)).pow(2).sum()) if grads else 0.0


class OuterNesterov(torch.optim.SGD):
    """DiLoCo's outer optimizer: SGD with Nesterov momentum on the averaged pseudo-gradient (the
    outer weights minus a replica's weights after its inner steps), skipping a step whose average is
    not finite, as ClippedAdamW does."""

    def __init__(self, params, lr: float, momentum: float):
        super().__init__(params, lr=lr, momentum=momentum, nesterov=momentum > 0)
        self.skipped = 0

    @torch.no_grad()
    def step(self, closure=None):
        if not math.isfinite(_grads(self)[1]):
            self.skipped += 1
            return None
        return super().step(closure)


class ClippedAdamW(torch.optim.AdamW):
    """AdamW that clips the gradient norm first (`clip` 0: no clipping), and skips a step whose
    gradient is not finite.

    `global_norm`, when given, turns this optimizer's squared gradient norm into the norm over the
    whole model: a stage of a pipeline then clips by the same coefficient as the reference trainer,
    which clips all parameters together. Without it, the norm is this optimizer's own."""

    def __init__(self, params, clip: float = 0.0, global_norm: Callable[[float], float] | None = None, **kwargs):
        super().__init__(params, **kwargs)
        self.clip, self.global_norm = clip, global_norm
        self.skipped = 0  # steps not taken because the gradient was not finite

    @torch.no_grad()
    def step(self, closure=None):
        grads, squared = _grads(self)
        if not math.isfinite(squared):
            self.skipped += 1  # a NaN or Inf would poison the weights and the moments for good
            return None
        if self.clip > 0:
            norm = self.global_norm(squared) if self.global_norm else math.sqrt(squared)
            coef = self.clip / (norm + 1e-6)  # as torch.nn.utils.clip_grad_norm_
            if coef < 1:
                torch._foreach_mul_(grads, coef)
        return super().step(closure)


def make_optimizer(groups, run: RunConfig, global_norm: Callable[[float], float] | None = None) -> ClippedAdamW:
    t = run.training
    return ClippedAdamW(groups, clip=t.grad_clip, global_norm=global_norm, lr=t.lr, betas=(t.beta1, t.beta2))


def primed(opt: torch.optim.AdamW) -> torch.optim.AdamW:
    """Give every parameter its AdamW state (zero moments, step 0), as the first step would.

    hivemind's state averager needs the optimizer's state tensors to exist (it shares them with
    late joiners), and when they do not, it makes them with a step on zero gradients: that moves
    Adam's step count to 1 (every later bias correction is then one step off, and the first real
    updates come out about a quarter smaller), decays the weights once, and runs the clipping.
    Here the state comes from AdamW's own step at a learning rate and weight decay of 0, which
    leaves the weights as they are, and the step count goes back to 0: the next step is then
    exactly a fresh AdamW's first step."""
    saved = [(g["lr"], g["weight_decay"]) for g in opt.param_groups]
    params = [p for g in opt.param_groups for p in g["params"]]
    grads = [p.grad for p in params]
    for g in opt.param_groups:
        g["lr"], g["weight_decay"] = 0.0, 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    torch.optim.AdamW.step(opt)  # AdamW's step, without the clipping of ClippedAdamW
    for p, grad in zip(params, grads, strict=True):
        p.grad = grad
    for g, (lr, wd) in zip(opt.param_groups, saved, strict=True):
        g["lr"], g["weight_decay"] = lr, wd
    for state in opt.state.values():
        state["step"].zero_()
    return opt


def make_outer_optimizer(params, run: RunConfig) -> OuterNesterov:
    a = run.averaging
    return OuterNesterov(params, lr=a.outer_lr, momentum=a.outer_momentum)
