"""The optimizer every trainer of a run uses: AdamW, weight decay on matrices only, clipped."""

from __future__ import annotations

import torch

from swarm.config import RunConfig


def param_groups(module: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only (not on norms), as in nanoGPT and Llama."""
    params = [p for p in module.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


class ClippedAdamW(torch.optim.AdamW):
    """AdamW that clips the gradient norm of its parameters first (`clip` 0: no clipping).

    Inside hivemind's Optimizer the step runs on the averaged gradient, so a stage clips the
    global batch's gradient, as the reference trainer does (per stage: the norm over the whole
    model would need every stage)."""

    def __init__(self, params, clip: float = 0.0, **kwargs):
        super().__init__(params, **kwargs)
        self.clip = clip
        self.skipped = 0  # steps not taken because the gradient was not finite

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.clip if self.clip > 0 else float("inf"))
        if not torch.isfinite(norm):
            self.skipped += 1  # a NaN or Inf would poison the weights and the moments for good
            return None
        return super().step(closure)


def make_optimizer(groups, run: RunConfig) -> ClippedAdamW:
    t = run.training
    return ClippedAdamW(groups, clip=t.grad_clip, lr=t.lr, betas=(t.beta1, t.beta2))
