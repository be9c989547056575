"""`python -m benchmarks local`: the reference trainer's tokens/s and peak memory for a config."""

from __future__ import annotations

import argparse
import resource

import torch

from benchmarks.results import append_row
from swarm.config import load_config
from swarm.device import resolve_device
from swarm.model import Stage
from swarm.trainer.local import train_local


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="configs/small.toml")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3, help="steps excluded from the tokens/s figure")
    p.add_argument("--device", default=None)


def tokens_per_s(records: list[dict], warmup: int) -> float:
    """Tokens/s after the first `warmup` steps (allocator and thread-pool start-up excluded)."""
    first, last = (records[min(warmup, len(records) - 1) - 1] if warmup else None), records[-1]
    if first is not None and last is not first:
        return (last["tokens"] - first["tokens"]) / (last["elapsed_s"] - first["elapsed_s"])
    return last["tokens_per_s"]


def run(args: argparse.Namespace) -> str:
    cfg = load_config(args.config)
    device = resolve_device(args.device)
    records = train_local(cfg, args.steps, device=str(device))
    tps = tokens_per_s(records, args.warmup)
    last = records[-1]
    if device.type == "cuda":
        peak = f"{torch.cuda.max_memory_allocated(device) / 2**20:.0f} MiB GPU"
    else:
        peak = f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB RSS"
    n_params = sum(p.numel() for p in Stage(cfg.with_stages(1), 0).parameters())
    return append_row(
        "local: reference trainer",
        ["config", "params", "device", "steps", "tokens/s", "peak memory", "final loss"],
        [args.config, f"{n_params / 1e6:.1f}M", device.type, args.steps, f"{tps:,.0f}", peak, f"{last['loss']:.3f}"],
    )
