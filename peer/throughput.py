"""How fast this device runs a stage: measured once per device and model, cached.

One stage is measured (the first this device serves); every other stage's throughput is derived
from it by the ratio of their compute per token (`stage_cost`). Measuring each stage separately
would compare numbers taken under different conditions (other processes, clocks, a GPU warming
up): on a shared machine two equal stages measured a minute apart differed by 60%, and peers that
rebalance on such numbers move back and forth between the stages. The ratio is exact for the
blocks (they are identical) and close for the head, which is what a move decision needs.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import torch

from swarm.config import RunConfig
from swarm.device import autocast, device_name
from swarm.join import join_headers
from swarm.model import Stage, lm_loss
from swarm.wire import encoded_nbytes


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


def stage_cost(run: RunConfig, stage: int) -> float:
    """Multiply-adds per token of the stage's forward: each block's projections, MLP and causal
    attention over seq_len, plus the LM head on the last stage (the embedding is a lookup)."""
    m = run.model
    kv = m.n_kv_heads * m.head_dim
    block = m.d_model * (2 * m.d_model + 2 * kv) + 3 * m.d_model * m.ffn_dim + m.seq_len * m.d_model
    cost = len(run.stage_layers(stage)) * block
    if stage == run.stages.count - 1:
        cost += m.d_model * m.vocab_size
    return float(cost)


def _key(device: torch.device, run: RunConfig, stage: int) -> str:
    return f"{device_name(device)}|{run.model_hash()}|stage {stage}|micro_batch {run.training.micro_batch}"


def cached_throughput(run: RunConfig, stage: int, device: torch.device) -> float:
    """Samples/s of `stage` on this device: derived from the lowest stage measured on it before
    (scaled by `stage_cost`), or measured now when none was."""
    path = cache_path()
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    measured = [k for k in range(run.stages.count) if _key(device, run, k) in cache]
    if not measured:
        cache[_key(device, run, stage)] = measure(run, stage, device)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        tmp.replace(path)
        measured = [stage]
    ref = min(measured)
    return float(cache[_key(device, run, ref)]) * stage_cost(run, ref) / stage_cost(run, stage)


def capacity(compute: float, up_bps: float, down_bps: float, bytes_out: float, bytes_in: float) -> float:
    """What a peer announces it can serve (rebalancing weighs peers by it), in samples/s: its device's
    `compute` with the time its link takes for a sample's traffic (`bytes_out` up, `bytes_in` down:
    activations forward, gradients backward) added, as one microbatch is received, computed and sent
    back. A fast GPU on a home uplink is weighed by what it serves through that uplink, as Petals'
    servers announce the lower of their compute and network throughput (`throughput.py`). Adding the
    times (not the lower of the two rates) is what a peer serving one microbatch at a time achieves; with
    microbatches in flight it overlaps them and does somewhat better, every peer alike."""
    return 1 / (1 / compute + 8 * bytes_out / up_bps + 8 * bytes_in / down_bps)


def sample_bytes(run: RunConfig, stage: int) -> tuple[float, float]:
    """(bytes sent, bytes received) per sample by a peer of `stage`: activations forward and gradients
    backward, as the run's wire codec encodes them; the first stage receives token ids, the last sends
    a loss."""
    m, codec = run.model, run.wire.codec
    hidden = encoded_nbytes(m.dtype, (m.seq_len, m.d_model), codec)
    first, last = stage == 0, stage == run.stages.count - 1
    sent = (0 if last else hidden) + (0 if first else hidden)
    received = (m.seq_len * 8 if first else hidden) + (0 if last else hidden)
    return float(sent), float(received)


def link_speed(url: str, join_token: str | None, nbytes: int = 2 * 2**20, timeout: float = 30.0) -> tuple[float, float]:
    """(uplink, downlink) in bits/s: an upload and a download of `nbytes` against the coordinator's
    link test (coordinator/api_speedtest.py), each timed from the request to the last byte."""
    headers = join_headers(join_token)
    where = url.rstrip("/") + "/api/v1/speedtest"
    with httpx.Client(timeout=timeout, headers=headers) as client:
        client.get(where, params={"bytes": 1}).raise_for_status()  # connected and admitted before timing
        start = time.perf_counter()
        client.post(where, content=os.urandom(nbytes)).raise_for_status()
        up = time.perf_counter() - start
        start = time.perf_counter()
        got = len(client.get(where, params={"bytes": nbytes}).raise_for_status().content)
        down = time.perf_counter() - start
    return 8 * nbytes / up, 8 * got / down
