"""The model cut into stages computes exactly what the whole model computes."""

import hashlib
import subprocess
import sys

import pytest
import torch

from swarm.config import load_config
from swarm.model import Stage, build_stages, lm_loss
from tests.conftest import CONFIGS, ROOT


@pytest.fixture(scope="module")
def run():
    return load_config(CONFIGS / "tiny.toml")


def batch(run, b=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, run.model.vocab_size, (b, run.model.seq_len), generator=g)
    y = torch.randint(0, run.model.vocab_size, (b, run.model.seq_len), generator=g)
    return x, y


def grads_by_name(stages) -> dict[str, torch.Tensor]:
    return {name: p.grad for s in stages for name, p in s.named_parameters()}


@pytest.mark.parametrize("count", [2, 3, 4])
def test_chained_stages_match_the_whole_model(run, count):
    whole = Stage(run.with_stages(1), 0)
    stages = build_stages(run.with_stages(count))
    x, y = batch(run)

    ref_logits = whole(x)
    ref_loss = lm_loss(ref_logits, y)
    ref_loss.backward()

    h = x
    for stage in stages:
        h = stage(h)
    loss = lm_loss(h, y)
    loss.backward()

    assert (h - ref_logits).abs().max().item() <= 1e-6
    assert abs(loss.item() - ref_loss.item()) <= 1e-6
    ref_grads, grads = grads_by_name([whole]), grads_by_name(stages)
    assert ref_grads.keys() == grads.keys()
    for name, g in grads.items():
        assert (g - ref_grads[name]).abs().max().item() <= 1e-6, name


def test_stage_owns_its_slice(run):
    first, middle, last = build_stages(run.with_stages(3, [1, 2, 1]))
    assert first.embed_tokens is not None and not hasattr(first, "lm_head")
    assert list(middle.layers) == ["1", "2"] and middle.embed_tokens is None
    assert last.lm_head.weight.shape == (run.model.vocab_size, run.model.d_model)
    h = first(batch(run)[0])
    assert h.shape == (2, run.model.seq_len, run.model.d_model)


def test_attention_is_causal(run):
    model = Stage(run.with_stages(1), 0)
    x, _ = batch(run, b=1)
    x2 = x.clone()
    x2[0, 64:] = (x2[0, 64:] + 1) % run.model.vocab_size
    with torch.no_grad():
        a, b = model(x), model(x2)
    assert torch.equal(a[0, :64], b[0, :64])
    assert not torch.equal(a[0, 64:], b[0, 64:])


BUILD = """
import hashlib, sys, torch
from swarm.config import load_config
from swarm.model import Stage
run = load_config(sys.argv[1]).with_stages(3)
stage = Stage(run, int(sys.argv[2]))
h = hashlib.sha256()
for name, t in sorted(stage.state_dict().items()):
    h.update(name.encode()); h.update(t.numpy().tobytes())
print(h.hexdigest())
"""


def stage_digest_in_new_process(stage: int) -> str:
    out = subprocess.run(
        [sys.executable, "-c", BUILD, str(CONFIGS / "tiny.toml"), str(stage)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return out.stdout.strip()


def test_independent_builds_of_a_stage_are_bitwise_identical(processes, run):
    a, b = stage_digest_in_new_process(1), stage_digest_in_new_process(1)
    assert a == b
    assert a != stage_digest_in_new_process(2)
    here = Stage(run.with_stages(3), 1)
    h = hashlib.sha256()
    for name, t in sorted(here.state_dict().items()):
        h.update(name.encode())
        h.update(t.numpy().tobytes())
    assert h.hexdigest() == a


def test_seed_changes_the_weights(run):
    other = run.model_copy(update={"training": run.training.model_copy(update={"seed": 1})})
    a, b = Stage(run, 0), Stage(other, 0)
    assert not torch.equal(a.embed_tokens.weight, b.embed_tokens.weight)
