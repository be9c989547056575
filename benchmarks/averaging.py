"""`python -m benchmarks averaging`: the swarm with per-stage averaging against the reference trainer.

In one run: `swarm train --local` on the config, then for each codec a coordinator, S stages x R
replicas of `swarm peer --no-rebalance --threads 1` and `swarm train --coordinator URL`, the same
number of global steps with the same data order and global batch. Every peer of a stage averages
its gradients with the others (hivemind.Optimizer), so the swarm should follow the reference's
loss curve.

Definitions:
- final loss = mean training loss of the last `--tail` steps (one step's loss is noisy);
- ratio = swarm final loss / reference final loss; the goal is within 2% (no codec) and 3% (int8);
- val loss = the last validation pass of each run (same validation batches);
- s/step = wall seconds per global step of the swarm trainer (matchmaking and all-reduce included).

Writes one row per codec, the loss curves (every `--every` steps) as a table in results.md, and
the plot benchmarks/averaging_loss.svg.
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import (
    ROOT,
    Proc,
    final_loss,
    last_val,
    log_dir,
    read_jsonl,
    start_coordinator,
    start_peer,
    stop_all,
    wait_online,
)
from benchmarks.plot import line_chart
from benchmarks.results import append_row, replace_section, target
from swarm.config import load_config

SECTION = "averaging: S stages x R replicas (averaged) ÷ the reference trainer"
CURVES = "averaging: loss curves"
PLOT_NAME = "averaging_loss.svg"  # beside the results file
GOALS = {"none": 0.02, "int8": 0.03}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="configs/tiny.toml")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--replicas", type=int, default=2, help="peers per stage")
    p.add_argument("--codecs", default="none,int8", help="comma-separated wire codecs to run the swarm with")
    p.add_argument("--matchmaking", type=float, default=0.5, help="averaging.matchmaking_time_s (loopback)")
    p.add_argument("--tail", type=int, default=10, help="steps averaged into the final loss")
    p.add_argument("--every", type=int, default=10, help="steps between rows of the loss-curve table")
    p.add_argument("--log-dir", default=None)


def variant(config: Path, codec: str, matchmaking: float) -> str:
    """The config's text with the codec set and loopback averaging timeouts (unless it sets its own)."""
    text = config.read_text()
    if re.search(r'(?m)^codec = "\w+"', text):
        text = re.sub(r'(?m)^codec = "\w+"', f'codec = "{codec}"', text)
    else:
        text += f'\n[wire]\ncodec = "{codec}"\n'
    if "[averaging]" not in text:
        text += f"\n[averaging]\nmatchmaking_time_s = {matchmaking}\nrequest_timeout_s = {matchmaking * 0.6:g}\n"
    return text


def run_swarm(config: Path, stages: int, replicas: int, steps: int, tmp: Path) -> tuple[list[dict], float]:
    procs: list[Proc] = []
    try:
        coordinator, url = start_coordinator(config, tmp / "coordinator.log")
        procs.append(coordinator)
        peers = {}
        for k in range(stages):
            for r in range(replicas):
                name = f"p{k}{chr(97 + r)}"
                peers[name] = start_peer(url, name, k, tmp, "--no-rebalance")
                procs.append(peers[name])
        wait_online(url, peers)
        log_json = tmp / "train.jsonl"
        started = time.monotonic()
        trainer = subprocess.run(
            [sys.executable, "-m", "swarm.cli", "train", "--coordinator", url, "--steps", str(steps)]
            + ["--log-json", str(log_json)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=None,  # the progress bar shows
            text=True,
        )
        wall = time.monotonic() - started
        if trainer.returncode != 0:
            raise RuntimeError(f"the swarm trainer exited with {trainer.returncode}:\n{trainer.stdout[-3000:]}")
        print(trainer.stdout, flush=True)
        return read_jsonl(log_json), wall
    finally:
        stop_all(procs)


def run(args: argparse.Namespace) -> str:
    cfg = load_config(args.config)
    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    tmp = log_dir(args.log_dir, "averaging")

    print(f"reference: swarm train --local, {args.steps} steps", flush=True)
    local_log = tmp / "local.jsonl"
    subprocess.run(
        [sys.executable, "-m", "swarm.cli", "train", "--local", "--config", args.config]
        + ["--steps", str(args.steps), "--log-json", str(local_log)],
        cwd=ROOT,
        check=True,
    )
    local = read_jsonl(local_log)
    curves = {"reference (--local)": local}
    rows = []
    for codec in codecs:
        run_dir = tmp / codec
        run_dir.mkdir(exist_ok=True)
        config = run_dir / "run.toml"
        config.write_text(variant(Path(args.config), codec, args.matchmaking))
        load_config(config)  # refuse a broken variant before starting processes
        print(f"swarm: {cfg.stages.count} stages x {args.replicas} replicas, codec {codec}", flush=True)
        records, wall = run_swarm(config, cfg.stages.count, args.replicas, args.steps, run_dir)
        curves[f"swarm {cfg.stages.count}x{args.replicas}, {codec}"] = records
        ref, ours = final_loss(local, args.tail), final_loss(records, args.tail)
        ratio = ours / ref
        goal = GOALS.get(codec, 0.03)
        met = "met" if abs(ratio - 1) <= goal else "not met"
        rows.append(
            append_row(
                SECTION,
                [
                    "config",
                    "swarm",
                    "codec",
                    "steps",
                    "reference final loss",
                    "swarm final loss",
                    "ratio",
                    "reference val",
                    "swarm val",
                    "swarm s/step",
                    "notes",
                ],
                [
                    args.config,
                    f"{cfg.stages.count} x {args.replicas}",
                    codec,
                    args.steps,
                    f"{ref:.4f}",
                    f"{ours:.4f}",
                    f"{ratio:.4f}",
                    f"{last_val(local):.4f}" if last_val(local) else "-",
                    f"{last_val(records):.4f}" if last_val(records) else "-",
                    f"{wall / args.steps:.2f}",
                    f"goal within {goal:.0%}: {met}; final loss = mean of the last {args.tail} steps; "
                    f"matchmaking {args.matchmaking} s, loopback, 1 torch thread per peer",
                ],
            )
        )

    names = list(curves)
    lines = ["| step | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for i in range(0, args.steps, args.every):
        cells = [f"{c[i]['loss']:.4f}" if i < len(c) else "-" for c in curves.values()]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    body = (
        f"Training loss per step, {args.config}, {args.steps} steps (run of {dt.date.today().isoformat()}); "
        "plot: [averaging_loss.svg](averaging_loss.svg).\n\n" + "\n".join(lines)
    )
    replace_section(CURVES, body)
    plot = target().parent / PLOT_NAME
    plot.write_text(
        line_chart(
            {n: [(r["step"], r["loss"]) for r in c] for n, c in curves.items()},
            f"training loss, {Path(args.config).name}: swarm vs reference",
            "global step",
            "loss",
        )
    )
    print(f"plot: {plot}", flush=True)
    return "\n".join(rows)
