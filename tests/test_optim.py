"""The optimizer every trainer uses: clipping, non-finite steps, and a state primed for hivemind."""

import copy

import torch

from swarm.config import load_config
from swarm.optim import make_optimizer, param_groups, primed
from tests.conftest import CONFIGS

RUN = load_config(CONFIGS / "tiny.toml")


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))


def train(m: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 3) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        m(torch.randn(4, 8, generator=gen)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


def test_a_primed_optimizer_steps_exactly_as_a_fresh_one():
    fresh, ready = model(), model()
    opt = primed(make_optimizer(param_groups(ready, 0.1), RUN))
    assert opt.state and all(float(s["step"]) == 0 for s in opt.state.values())  # hivemind sees a state
    # no decay, no move
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), ready.parameters(), strict=True))
    train(fresh, make_optimizer(param_groups(fresh, 0.1), RUN))
    train(ready, opt)
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), ready.parameters(), strict=True))


def test_clipping_matches_torch_and_a_non_finite_gradient_is_skipped():
    ours, theirs = model(), model()
    opt = make_optimizer(param_groups(ours, 0.0), RUN)  # clip 1.0 in tiny.toml
    ref = torch.optim.AdamW(param_groups(theirs, 0.0), lr=RUN.training.lr, betas=(0.9, 0.95))
    ref.param_groups[0]["betas"] = ref.param_groups[1]["betas"] = (RUN.training.beta1, RUN.training.beta2)
    x = torch.randn(4, 8) * 100
    for m in (ours, theirs):
        m(x).pow(2).sum().backward()
    torch.nn.utils.clip_grad_norm_(theirs.parameters(), RUN.training.grad_clip)
    opt.step()
    ref.step()
    # clipped in place, by the same coefficient as torch's
    pairs = list(zip(ours.parameters(), theirs.parameters(), strict=True))
    assert all(torch.allclose(a.grad, b.grad, rtol=1e-5) for a, b in pairs)
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in pairs)
    before = copy.deepcopy(ours.state_dict())
    opt.zero_grad()
    ours[0].weight.grad = torch.full_like(ours[0].weight, float("nan"))
    opt.step()
    assert opt.skipped == 1
    assert all(torch.equal(v, ours.state_dict()[k]) for k, v in before.items())
