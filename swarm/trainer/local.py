"""The reference trainer: the whole model in one process.

It is the yardstick for the swarm: the same config, data order and global batch trained here give
the loss curve and the tokens/s that the distributed run is compared against.
"""

from __future__ import annotations

import torch

from swarm.config import RunConfig
from swarm.data import TrainStream
from swarm.device import autocast, device_name, resolve_device
from swarm.model import Stage, lm_loss
from swarm.optim import make_optimizer, param_groups
from swarm.progress import RunLog, eval_due
from swarm.schedule import lr_at


@torch.no_grad()
def evaluate(model: Stage, batches, device: torch.device, dtype: str) -> float:
    model.eval()
    losses = []
    for b in batches:
        with autocast(device, dtype):
            losses.append(lm_loss(model(b.inputs.to(device)), b.targets.to(device)).item())
    model.train()
    return sum(losses) / len(losses)


def train_local(run: RunConfig, steps: int, device: str | None = None, log_json=None) -> list[dict]:
    """Train `steps` optimizer steps; return the per-step records (as written to `log_json`)."""
    dev = resolve_device(device)
    run = run.with_stages(1) if run.stages.count != 1 else run
    t = run.training
    torch.manual_seed(t.seed)
    data = TrainStream.local(run.data, run.model.seq_len, t.seed)
    val = data.val_batches(t.eval_batches, t.micro_batch)
    model = Stage(run, 0).to(dev)
    opt = make_optimizer(param_groups(model, t.weight_decay), run)
    scaler = torch.amp.GradScaler(dev.type, enabled=dev.type == "cuda" and run.model.dtype == "float16")
    n_params = sum(p.numel() for p in model.parameters())
    log = RunLog(steps, log_json, desc=f"train --local ({device_name(dev)})")
    tokens_per_step = t.global_batch * run.model.seq_len
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    for step in range(steps):
        lr = lr_at(step, t)
        for group in opt.param_groups:
            group["lr"] = lr
        loss_sum = 0.0
        for _ in range(t.accumulation):
            b = data.next_microbatch(t.micro_batch)
            with autocast(dev, run.model.dtype):
                loss = lm_loss(model(b.inputs.to(dev, non_blocking=True)), b.targets.to(dev, non_blocking=True))
            scaler.scale(loss / t.accumulation).backward()
            data.trained(b)
            loss_sum += loss.item()
        scaler.step(opt)  # unscales, then the optimizer clips
        scaler.update()
        opt.zero_grad(set_to_none=True)
        val_loss = None
        if eval_due(step, steps, t.eval_every):
            val_loss = evaluate(model, val, dev, run.model.dtype)
        log.step(step, loss_sum / t.accumulation, tokens_per_step, val_loss, lr=lr)
    facts = {"parameters": f"{n_params:,}", "device": device_name(dev)}
    if dev.type == "cuda":
        facts["peak GPU memory"] = f"{torch.cuda.max_memory_allocated(dev) / 2**20:.0f} MiB"
    log.close(**facts)
    return log.records
