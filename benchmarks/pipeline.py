"""`python -m benchmarks pipeline`: tokens/s through 2 stage workers + 1 trainer ÷ the reference trainer.

Both are measured in the same run on the same machine: the reference trainer (the whole model in
this process) and then, per codec, two `swarm peer` processes serving the two stages with the
pipelined trainer driving them. Efficiency = pipeline tokens/s ÷ reference tokens/s. Bytes on the
wire per token are counted by the trainer's clients (both directions, all stages).

With `--delayed-updates`, per codec the pipeline runs twice on fresh workers, synchronous and with
delayed updates (the trainer sends a step's microbatches while the previous step's finish,
swarm/trainer/loop.py `overlap`), and a row of its own section gives both efficiencies and both
losses (the mean of the last 5 steps' training losses): what the delay gains in speed and costs per
step (the synchronous run's row goes to the usual section too).
"""

from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path

import torch

from benchmarks.common import Proc, stop_all
from benchmarks.results import append_row
from swarm.config import RunConfig, load_config
from swarm.ready import PeerReady, wait_ready
from swarm.trainer.local import train_local
from swarm.trainer.options import TrainerOptions
from swarm.trainer.pipeline import train_pipeline


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="configs/small.toml")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="steps excluded from tokens/s")
    p.add_argument("--codecs", default="none,fp16,bf16,int8")
    p.add_argument("--inflight", type=int, default=4)
    p.add_argument("--threads", type=int, default=0, help="torch threads per stage worker (0: torch's default)")
    p.add_argument("--device", default=None, help="device for the reference trainer and the workers")
    p.add_argument(
        "--delayed-updates",
        action="store_true",
        help="per codec, delayed updates beside the synchronous run (a section of their own)",
    )


DELAYED_SECTION = "pipeline: delayed updates vs synchronous, 2 stage workers + trainer ÷ reference trainer"


def steady_tokens_per_s(records: list[dict], warmup: int, lead: int = 0) -> float:
    """Tokens/s of the steps after the first `warmup`: their tokens over the time from the end of
    step warmup - 1 to the last record, or with `lead`, from `lead` steps earlier (with delayed
    updates a step begins before the previous one ends: a lower bound). With no such step: the run's."""
    start, last = warmup - 1 - lead, records[-1]
    if warmup < 1 or start < 0:
        return last["tokens_per_s"]
    tokens = last["tokens"] - records[warmup - 1]["tokens"]
    return tokens / (last["elapsed_s"] - records[start]["elapsed_s"])


def start_workers(
    config_path: Path, stages: int, threads: int, device: str | None, log_dir: Path, *extra: str
) -> tuple[list[Proc], list[str]]:
    """A `swarm peer --config` per stage (with the options in `extra`), and their addresses once all of them serve."""
    procs = []
    for k in range(stages):
        args = ["peer", "--config", str(config_path), "--stage", str(k), "--port", "0", *extra]
        if threads:
            args += ["--threads", str(threads)]
        if device:
            args += ["--device", device]
        procs.append(Proc(args, log_dir / f"stage{k}.log", ready=True))
    try:
        return procs, [wait_ready(p, PeerReady, timeout=120).address for p in procs]
    except BaseException:
        stop_all(procs)
        raise


def with_codec(run: RunConfig, codec: str, path: Path, source: Path) -> RunConfig:
    text = re.sub(r'(?m)^codec = ".*"$', f'codec = "{codec}"', source.read_text())
    text = re.sub(r"(?m)^eval_every = \d+$", "eval_every = 0", text)
    path.write_text(text)
    return load_config(path)


def train_through_workers(cfg_path: Path, cfg: RunConfig, args: argparse.Namespace, tmp: Path, delayed: bool):
    """Two fresh stage workers serving `cfg`, trained through for `args.steps` steps; the records."""
    procs, addresses = start_workers(
        cfg_path, cfg.stages.count, args.threads, args.device, tmp, "--inflight", str(args.inflight)
    )
    try:
        opts = TrainerOptions(steps=args.steps, inflight=args.inflight, delayed_updates=delayed)
        return train_pipeline(cfg, addresses, opts)
    finally:
        stop_all(procs)


def last_losses(records: list[dict], n: int = 5) -> float:
    return sum(r["loss"] for r in records[-n:]) / len(records[-n:])


def run(args: argparse.Namespace) -> str:
    source = Path(args.config)
    base = load_config(source)
    if base.stages.count != 2:
        base = base.with_stages(2)
    print(f"reference trainer: {args.steps} steps of {args.config}", flush=True)
    ref = steady_tokens_per_s(train_local(base, args.steps, device=args.device), args.warmup)
    threads = f"workers {args.threads or torch.get_num_threads()} thread(s) each, {args.inflight} in flight"
    rows, out = [], []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for codec in args.codecs.split(","):
            cfg_path = tmp / f"{codec}.toml"
            cfg = with_codec(base, codec, cfg_path, source)
            print(f"pipeline, codec {codec}: 2 workers x {args.threads} threads, {args.inflight} in flight", flush=True)
            sync = train_through_workers(cfg_path, cfg, args, tmp, delayed=False)
            tps = steady_tokens_per_s(sync, args.warmup)
            rows.append((codec, tps, sync[-1]["wire_bytes"] / sync[-1]["tokens"]))
            if args.delayed_updates:
                print(f"pipeline, codec {codec}, delayed updates", flush=True)
                delayed = train_through_workers(cfg_path, cfg, args, tmp, delayed=True)
                speeds = [tps, steady_tokens_per_s(delayed, args.warmup, lead=1)]
                out.append(
                    append_row(
                        DELAYED_SECTION,
                        [
                            "config",
                            "codec",
                            "steps",
                            "reference tokens/s",
                            "synchronous tokens/s",
                            "delayed tokens/s",
                            "efficiency synchronous",
                            "efficiency delayed",
                            "loss synchronous",
                            "loss delayed",
                            "notes",
                        ],
                        [
                            args.config,
                            codec,
                            args.steps,
                            f"{ref:,.0f}",
                            *(f"{x:,.0f}" for x in speeds),
                            *(f"{x / ref:.2f}" for x in speeds),
                            *(f"{last_losses(r):.4f}" for r in (sync, delayed)),
                            f"{threads}; loss = mean training loss of the last 5 steps; delayed tokens/s over "
                            "one step more of time (each of its steps begins before the previous one ends); "
                            "goal efficiency >= 0.9",
                        ],
                    )
                )
    fp32 = next((b for c, _, b in rows if c == "none"), None)
    for codec, tps, per_token in rows:
        out.append(
            append_row(
                "pipeline: 2 stage workers + trainer ÷ reference trainer",
                [
                    "config",
                    "codec",
                    "steps",
                    "reference tokens/s",
                    "pipeline tokens/s",
                    "efficiency",
                    "wire bytes/token",
                    "÷ fp32",
                    "notes",
                ],
                [
                    args.config,
                    codec,
                    args.steps,
                    f"{ref:,.0f}",
                    f"{tps:,.0f}",
                    f"{tps / ref:.2f}",
                    f"{per_token:,.0f}",
                    f"{per_token / fp32:.3f}" if fp32 else "-",
                    f"{threads}; goal efficiency >= 0.9, int8 <= 0.26 x fp32",
                ],
            )
        )
    print("\n".join(out))
    return out[-1]
