"""How fast this device runs one stage: measured once, cached per device and model."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from swarm.config import RunConfig
from swarm.device import autocast, device_name
from swarm.model import Stage, lm_loss


def cache_path() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "swarm" / "throughput.json"


def measure(run: RunConfig, stage: int, device: torch.device, repeats: int = 3) -> float:
    """Samples/s of forward + backward of `stage` on a microbatch of the run's shape."""
    model = Stage(run, stage).to(device)
    b, t = run.training.micro_batch, run.model.seq_len
    if model.is_first:
        x = torch.randint(0, run.model.vocab_size, (b, t), device=device)
    else:
        x = torch.randn(b, t, run.model.d_model, device=device)
    targets = torch.randint(0, run.model.vocab_size, (b, t), device=device)
    times = []
    for _ in range(repeats + 1):  # the first run warms up allocators and kernels
        start = time.perf_counter()
        with autocast(device, run.model.dtype):
            out = model(x.requires_grad_(not model.is_first) if not model.is_first else x)
        loss = lm_loss(out, targets) if model.is_last else out.float().square().mean()
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return b / min(times[1:])


def cached_throughput(run: RunConfig, stage: int, device: torch.device) -> float:
    """The measured throughput, from the cache when this device has run this stage before."""
    key = f"{device_name(device)}|{run.model_hash()}|stage {stage}|micro_batch {run.training.micro_batch}"
    path = cache_path()
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if key not in cache:
        cache[key] = measure(run, stage, device)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        tmp.replace(path)
    return float(cache[key])
