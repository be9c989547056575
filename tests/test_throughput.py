"""The throughput cache: one stage measured per device and model, the others derived from it."""

from __future__ import annotations

import json

import torch

from peer.throughput import cache_path, cached_throughput, stage_cost
from swarm.config import load_config
from tests.conftest import CONFIGS


def test_one_stage_is_measured_and_the_others_follow_by_their_cost(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    run = load_config(CONFIGS / "tiny.toml")
    cpu = torch.device("cpu")
    first = cached_throughput(run, 1, cpu)  # measured: the cache now holds stage 1 only
    cache = json.loads(cache_path().read_text())
    assert len(cache) == 1 and next(iter(cache)).endswith("|stage 1|micro_batch 8")
    # stage 0 is derived, not measured (no second entry), in proportion to the compute per token
    assert cached_throughput(run, 0, cpu) == first * stage_cost(run, 1) / stage_cost(run, 0)
    assert len(json.loads(cache_path().read_text())) == 1
    assert cached_throughput(run, 1, cpu) == first  # and the measured one is read back
    # a cache that holds several stages (older versions measured each) derives from the lowest
    key0 = next(iter(cache)).replace("stage 1", "stage 0")
    cache_path().write_text(json.dumps({**cache, key0: 1000.0}))
    assert cached_throughput(run, 1, cpu) == 1000.0 * stage_cost(run, 0) / stage_cost(run, 1)


def test_stage_cost_counts_blocks_and_the_head():
    run = load_config(CONFIGS / "1b.toml")  # layers 5, 6, 6, 5; the last stage has the LM head
    costs = [stage_cost(run, k) for k in range(4)]
    assert costs[1] == costs[2] and costs[1] / costs[0] == 6 / 5
    m = run.model
    assert costs[3] - costs[0] == m.d_model * m.vocab_size
