"""What a replica hands to its stage's average: its gradient when it is finite, scaled to the mean of
the samples it served, and clipped, so that no single peer's gradient can become the average."""

from __future__ import annotations

import torch


def grads_finite(module: torch.nn.Module) -> bool:
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return True
    norms = torch._foreach_norm(grads)
    return bool(torch.isfinite(torch.stack(norms)).all())


def scale_grads(module: torch.nn.Module, factor: float) -> None:
    for p in module.parameters():
        if p.grad is not None:
            p.grad.mul_(factor)


def drop_grads(module: torch.nn.Module) -> None:
    for p in module.parameters():
        if p.grad is not None:
            p.grad.zero_()


def clip_contribution(module: torch.nn.Module, max_norm: float) -> float:
    """Scale this peer's gradient down to norm `max_norm` when it is longer (`max_norm` 0: never);
    returns the factor applied (1.0 when left as it was).

    The stage's average is a weighted mean of its peers' gradients, so without a bound one peer's
    gradient a thousand times too long (a bug, a bad device, a bad actor) is the average, and the
    step then goes wherever it points. Clipping each contribution bounds its share of the average
    by its sample weight times `max_norm`.

    The bound is a multiple of `training.grad_clip` (`averaging.contribution_clip`, 10 by default)
    rather than `grad_clip` itself, because the step clips the averaged gradient again by the
    global norm: that final clip keeps the step's length, and this one only has to keep a single
    peer from taking over its direction. A bound at `grad_clip` would clip most honest gradients
    early in training (over one micro-batch of configs/tiny.toml a stage's gradient reaches 7x
    `grad_clip` in its first steps and about 10x in loss spikes), reweighting the samples away from
    the reference trainer's mean; at 10x an honest gradient is left alone nearly always."""
    if max_norm <= 0:
        return 1.0
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return 1.0
    norm = float(torch.stack(torch._foreach_norm(grads)).norm())
    if norm <= max_norm:
        return 1.0
    factor = max_norm / norm
    torch._foreach_mul_(grads, factor)
    return factor
