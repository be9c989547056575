"""`python -m benchmarks scale`: the real model sizes (125m, 1b), reference trainer vs a 2-stage swarm.

Per config, in one run on one machine: the reference trainer (the whole model in this process),
then two `swarm peer --config` processes serving the config cut into 2 stages, driven by the
pipelined trainer. A row gives both tokens/s and their ratio, the loss at the first and the last
step (it must fall), the peak RSS (VmHWM) of this process after the reference and of each stage
worker, and on CUDA the peak GPU memory of each (torch.cuda.max_memory_allocated; the workers print
theirs when they stop) and the MFU: achieved model FLOP/s over the GPU's bf16 dense peak, with
FLOPs per token = 6 x non-embedding parameters (all but the token embedding) + 12 x n_layers x
d_model x seq_len (attention). Both stage workers share the one GPU, so the swarm's MFU is over one
GPU's peak too. On CPU, a few steps at a smaller batch (--micro-batch, --global-batch) end in
minutes; the columns that need a GPU say "-".
"""

from __future__ import annotations

import argparse
import gc
import re
from pathlib import Path

import torch

from benchmarks.common import ROOT, Proc, log_dir, stop_all
from benchmarks.pipeline import start_workers, steady_tokens_per_s
from benchmarks.results import append_row
from swarm.config import RunConfig, dump_config, load_config
from swarm.device import device_name, resolve_device
from swarm.memory import stage_parameters
from swarm.trainer.local import train_local
from swarm.trainer.options import TrainerOptions
from swarm.trainer.pipeline import train_pipeline

SECTION = "scale: reference trainer vs 2-stage swarm at real model sizes"
# bf16 dense tensor-core peaks, TFLOP/s, by a part of the device's name (first match wins).
PEAK_TFLOPS = {"H100 SXM": 989.0, "H100 80GB HBM3": 989.0, "H200": 989.0, "A100": 312.0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--configs", default="125m", help="comma-separated names in configs/ or paths (default 125m)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="steps excluded from tokens/s")
    p.add_argument("--micro-batch", type=int, default=None, help="override training.micro_batch (CPU: 1)")
    p.add_argument("--global-batch", type=int, default=None, help="override training.global_batch (CPU: 2)")
    p.add_argument("--checkpoint-activations", action="store_true", help="[model] checkpoint_activations = true")
    p.add_argument("--inflight", type=int, default=4, help="microbatches in flight, and graphs each worker keeps")
    p.add_argument("--threads", type=int, default=0, help="torch threads per stage worker (0: torch's default)")
    p.add_argument("--device", default=None, help="cpu, cuda (default: auto)")
    p.add_argument("--peak-tflops", type=float, default=None, help="the GPU's bf16 dense peak, when not in the table")
    p.add_argument("--log-dir", default=None)


def config_path(name: str) -> Path:
    path = Path(name)
    return path if path.suffix == ".toml" else ROOT / "configs" / f"{name}.toml"


def sized(run: RunConfig, micro: int | None, global_batch: int | None, checkpoint: bool = False) -> RunConfig:
    """The run cut into 2 stages, without validation passes, at the batch sizes asked for (and with
    activation checkpointing when `checkpoint`)."""
    data = run.with_stages(2).model_dump()
    data["training"].update(eval_every=0)
    if checkpoint:
        data["model"]["checkpoint_activations"] = True
    if micro is not None:
        data["training"]["micro_batch"] = micro
    if global_batch is not None:
        data["training"]["global_batch"] = global_batch
    return RunConfig.model_validate(data)


def flops_per_token(run: RunConfig) -> float:
    m = run.model
    params = sum(stage_parameters(run, k) for k in range(run.stages.count)) - m.vocab_size * m.d_model
    return 6 * params + 12 * m.n_layers * m.d_model * m.seq_len


def peak_tflops(device: torch.device, given: float | None) -> float | None:
    if given is not None:
        return given
    name = device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def vm_hwm(pid: int | str) -> int:
    """A process's peak resident memory, bytes (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmHWM")


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def worker_gpu_peaks(procs: list[Proc]) -> list[str]:
    """The peak GPU memory each stopped worker printed, MiB."""
    peaks = []
    for p in procs:
        m = re.search(r"peak GPU memory (\d+) MiB", p.output())
        peaks.append(f"{int(m.group(1)):,}" if m else "?")
    return peaks


def measure(name: str, args: argparse.Namespace, tmp: Path) -> str:
    source = config_path(name)
    run = sized(load_config(source), args.micro_batch, args.global_batch, args.checkpoint_activations)
    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    tokens_per_step = run.training.global_batch * run.model.seq_len
    print(f"scale {name}: reference trainer, {args.steps} steps of {tokens_per_step:,} tokens on {device}", flush=True)
    ref = train_local(run, args.steps, device=str(device))
    ref_rss = vm_hwm("self")
    ref_gpu = mib(torch.cuda.max_memory_allocated(device)) if cuda else "-"
    if cuda:
        gc.collect()  # the reference's model and optimizer, if a cycle still holds them
        torch.cuda.empty_cache()  # leave the GPU to the workers
    cfg = tmp / f"{source.stem}-2stages.toml"
    cfg.write_text(dump_config(run))
    print(f"scale {name}: 2 stage workers, {args.inflight} in flight", flush=True)
    procs, addresses = start_workers(cfg, 2, args.threads, args.device, tmp, "--inflight", str(args.inflight))
    try:
        swarm = train_pipeline(run, addresses, TrainerOptions(steps=args.steps, inflight=args.inflight))
        rss = [vm_hwm(p.popen.pid) for p in procs]
    finally:
        stop_all(procs)
    gpu = worker_gpu_peaks(procs) if cuda else ["-", "-"]
    ref_tps, swarm_tps = steady_tokens_per_s(ref, args.warmup), steady_tokens_per_s(swarm, args.warmup)
    peak = peak_tflops(device, args.peak_tflops) if cuda else None
    per_token = flops_per_token(run)

    def mfu(tps: float) -> str:
        if not cuda:
            return "-"
        return f"{tps * per_token / (peak * 1e12):.3f}" if peak else "n/a"

    params = sum(stage_parameters(run, k) for k in range(2))
    notes = (
        f"{run.model.dtype if cuda else 'float32'}, micro_batch {run.training.micro_batch}, "
        f"{'activation checkpointing, ' if run.model.checkpoint_activations else ''}"
        f"global_batch {run.training.global_batch}, {args.inflight} in flight, tokens/s after {args.warmup} "
        f"step(s); FLOPs/token {per_token / 1e9:.2f} G = 6 x non-embedding params + 12 x layers x d_model x seq_len"
        + (f", peak {peak:.0f} TFLOP/s bf16 dense" if peak else "")
        + "; RSS = VmHWM"
    )
    return append_row(
        SECTION,
        [
            "config",
            "params",
            "device",
            "steps",
            "local tokens/s",
            "swarm tokens/s",
            "swarm ÷ local",
            "local MFU",
            "swarm MFU",
            "local peak RSS MiB",
            "workers peak RSS MiB",
            "local peak GPU MiB",
            "workers peak GPU MiB",
            "local loss first → last",
            "swarm loss first → last",
            "notes",
        ],
        [
            name,
            f"{params / 1e6:.1f}M",
            device_name(device),
            args.steps,
            f"{ref_tps:,.0f}",
            f"{swarm_tps:,.0f}",
            f"{swarm_tps / ref_tps:.2f}",
            mfu(ref_tps),
            mfu(swarm_tps),
            mib(ref_rss),
            " / ".join(mib(r) for r in rss),
            ref_gpu,
            " / ".join(gpu),
            f"{ref[0]['loss']:.3f} → {ref[-1]['loss']:.3f}",
            f"{swarm[0]['loss']:.3f} → {swarm[-1]['loss']:.3f}",
            notes,
        ],
    )


def run(args: argparse.Namespace) -> str:
    tmp = log_dir(args.log_dir, "scale")
    rows = [measure(name.strip(), args, tmp) for name in args.configs.split(",")]
    print("\n".join(rows))
    return rows[-1]
