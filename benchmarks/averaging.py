"""`python -m benchmarks averaging`: the swarm with per-stage averaging against the reference trainer.

In one run: `swarm train --local` on the config, then for each variant (`--variants`: the wire codec,
`[averaging] compression` and mode, e.g. `none/int8` or, DiLoCo with 10 inner steps, `int8/int8/diloco10`)
a coordinator, S stages x R replicas of `swarm peer
--no-rebalance --threads 1` and `swarm train --coordinator URL`, the same number of global steps
with the same data order and global batch. Every peer of a stage averages its gradients with the
others (hivemind.Optimizer) every step, or, DiLoCo, its pseudo-gradient every H steps; the swarm
should follow the reference's loss curve.

Definitions:
- final loss = mean training loss of the last `--tail` steps (one step's loss is noisy);
- ratio = swarm final loss / reference final loss; the goal is at most 1.02 (no codec) and 1.03 (int8);
- val loss = the last validation pass of each run, right after its last step: the loss of the model
  the run produced on `--eval-batches` held-out micro-batches, the same for both runs (DiLoCo, when
  the steps are a multiple of H: the outer weights, what `swarm export` takes; the training loss
  of a DiLoCo run is its replicas' inner weights within a phase); the goal is checked on both;
- s/step = wall seconds per global step of the swarm trainer (matchmaking and all-reduce included);
- averaging bytes / param / step = the bytes the stages' all-reduces moved (each replica counts the
  parts it reduced for the others, received and sent back: peer/allreduce.py; from the peers'
  `--log-steps` lines), over the model's parameters and the steps: what one replica's link carries
  (up and down together) when each stage has 2 replicas; per token: the same over the tokens of a
  global batch.

Writes one row per codec, the loss curves (every `--every` steps) as a table in results.md, and
the plot benchmarks/averaging_loss.svg.
"""

from __future__ import annotations

import argparse
import datetime as dt
import time
from pathlib import Path
from typing import get_args

from benchmarks.common import (
    Proc,
    averaging_spec,
    final_loss,
    last_val,
    log_dir,
    read_jsonl,
    read_step_logs,
    run_to_end,
    spec_name,
    start_coordinator,
    start_peer,
    stop_all,
    wait_online,
    with_averaging,
    with_eval_batches,
    with_wire,
)
from benchmarks.plot import line_chart
from benchmarks.results import append_row, replace_section, target
from swarm.config import Codec, load_config
from swarm.model import build_stages

SECTION = "averaging: S stages x R replicas ÷ the reference trainer, by wire codec and averaging (mode, compression)"
CURVES = "averaging: loss curves"
PLOT_NAME = "averaging_loss.svg"  # beside the results file
GOALS = {"none": 0.02, "int8": 0.03}  # by wire codec

LOOPBACK_MATCHMAKING_S = 0.5  # averaging.matchmaking_time_s for replicas on one machine


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="configs/tiny.toml")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--replicas", type=int, default=2, help="peers per stage")
    p.add_argument(
        "--variants",
        type=variants,
        default="none/none,none/int8,int8/int8,int8/int8/diloco10",
        help="comma-separated WIRE/COMPRESSION[/dilocoH[-lrLR][-mM][-pinned]]: the wire codec, [averaging] "
        "compression and (DiLoCo, H inner steps, outer learning rate and momentum, pinned paths) mode of each "
        "swarm run",
    )
    p.add_argument(
        "--matchmaking", type=float, default=LOOPBACK_MATCHMAKING_S, help="averaging.matchmaking_time_s (loopback)"
    )
    p.add_argument("--tail", type=int, default=10, help="steps averaged into the final loss")
    p.add_argument(
        "--eval-batches", type=int, default=16, help="held-out micro-batches of the validation passes (both runs)"
    )
    p.add_argument("--every", type=int, default=10, help="steps between rows of the loss-curve table")
    p.add_argument("--log-dir", default=None)


def variants(text: str) -> list[tuple[str, str]]:
    """`none/int8,int8/int8/diloco10` -> [("none", "int8"), ("int8", "int8/diloco10")], each checked against
    the config's choices (benchmarks/common.py `averaging_spec`)."""
    out = []
    for item in (i.strip() for i in text.split(",") if i.strip()):
        wire, _, averaging = item.partition("/")
        if wire not in get_args(Codec):
            raise argparse.ArgumentTypeError(f"{item!r}: WIRE/... with WIRE one of {', '.join(get_args(Codec))}")
        out.append((wire, spec_name(averaging_spec(averaging))))
    if not out:
        raise argparse.ArgumentTypeError("no variant given")
    return out


def variant(config: Path, codec: str, averaging: str, matchmaking: float, eval_batches: int | None = None) -> str:
    """The config's text with the wire codec, the averaging (`averaging_spec`) and (unless None) the
    validation batches set, and loopback averaging timeouts (unless it sets its own)."""
    text = config.read_text()
    text = with_wire(with_eval_batches(text, eval_batches) if eval_batches else text, codec)
    if "[averaging]" not in text:
        text += f"\n[averaging]\nmatchmaking_time_s = {matchmaking}\nrequest_timeout_s = {matchmaking * 0.6:g}\n"
    return with_averaging(text, averaging_spec(averaging))


def run_swarm(config: Path, stages: int, replicas: int, steps: int, tmp: Path) -> tuple[list[dict], float, int]:
    """The trainer's records, its wall seconds, and the bytes the stages' all-reduces moved."""
    procs: list[Proc] = []
    step_logs: dict[str, Path] = {}
    try:
        coordinator, url = start_coordinator(config, tmp / "coordinator.log")
        procs.append(coordinator)
        peers = {}
        for k in range(stages):
            for r in range(replicas):
                name = f"p{k}{chr(97 + r)}"
                step_logs[name] = tmp / f"{name}.steps"
                peers[name] = start_peer(url, name, k, tmp, "--no-rebalance", "--log-steps", str(step_logs[name]))
                procs.append(peers[name])
        wait_online(url, peers)
        log_json = tmp / "train.jsonl"
        started = time.monotonic()
        args = ["train", "--coordinator", url, "--steps", str(steps), "--log-json", str(log_json)]
        out = run_to_end(args, tmp / "trainer.log", procs)
        wall = time.monotonic() - started
        print(out[out.rfind("summary") :], flush=True)
    finally:
        stop_all(procs)
    moved = sum(entry.get("reduced_bytes", 0) for entry in read_step_logs(step_logs))
    return read_jsonl(log_json), wall, moved


def run(args: argparse.Namespace) -> str:
    cfg = load_config(args.config)
    params = sum(p.numel() for stage in build_stages(cfg) for p in stage.parameters())
    tmp = log_dir(args.log_dir, "averaging")

    print(f"reference: swarm train --local, {args.steps} steps", flush=True)
    local_log, local_config = tmp / "local.jsonl", tmp / "local.toml"
    local_config.write_text(with_eval_batches(Path(args.config).read_text(), args.eval_batches))
    run_to_end(
        ["train", "--local", "--config", str(local_config), "--steps", str(args.steps), "--log-json", str(local_log)],
        tmp / "local.log",
    )
    local = read_jsonl(local_log)
    curves = {"reference (--local)": local}
    rows = []
    tokens = cfg.training.global_batch * cfg.model.seq_len  # per step
    for codec, averaging in args.variants:
        settings = averaging_spec(averaging)
        compression, mode = settings["compression"], averaging.partition("/")[2] or "gradients"
        run_dir = tmp / f"{codec}-{averaging.replace('/', '-')}"
        run_dir.mkdir(exist_ok=True)
        config = run_dir / "run.toml"
        config.write_text(variant(Path(args.config), codec, averaging, args.matchmaking, args.eval_batches))
        outer = load_config(config).averaging  # refuses a broken variant before starting processes
        print(f"swarm: {cfg.stages.count} stages x {args.replicas} replicas, wire {codec}, averaging {averaging}")
        records, wall, moved = run_swarm(config, cfg.stages.count, args.replicas, args.steps, run_dir)
        curves[f"swarm {cfg.stages.count}x{args.replicas}, {codec}/{averaging}"] = records
        ref, ours = final_loss(local, args.tail), final_loss(records, args.tail)
        ratio = ours / ref
        goal = GOALS.get(codec, 0.03) if compression == "none" else 0.03
        met = "met" if ratio <= 1 + goal else "not met"  # a loss below the reference's is no miss
        vals = (last_val(local), last_val(records))
        val_ratio = vals[1] / vals[0] if all(vals) else None
        if val_ratio is not None:
            on = ""  # DiLoCo: which weights the last validation pass ran on
            if mode != "gradients":
                on = " (outer weights)" if args.steps % settings["inner_steps"] == 0 else " (inner weights, mid-phase)"
            met = f"training loss {met}, final model's held-out loss{on} " + (
                "met" if val_ratio <= 1 + goal else "not met"
            )
        per_param = moved / params / args.steps
        rows.append(
            append_row(
                SECTION,
                [
                    "config",
                    "swarm",
                    "wire codec",
                    "averaging mode",
                    "averaging compression",
                    "steps",
                    "reference final loss",
                    "swarm final loss",
                    "ratio",
                    "reference val",
                    "swarm val",
                    "swarm s/step",
                    "averaging bytes / param / step",
                    "averaging bytes / param / token",
                    "notes",
                ],
                [
                    args.config,
                    f"{cfg.stages.count} x {args.replicas}",
                    codec,
                    mode,
                    compression,
                    args.steps,
                    f"{ref:.4f}",
                    f"{ours:.4f}",
                    f"{ratio:.4f}",
                    f"{last_val(local):.4f}" if last_val(local) else "-",
                    f"{last_val(records):.4f}" if last_val(records) else "-",
                    f"{wall / args.steps:.2f}",
                    f"{per_param:.2f}",
                    f"{per_param / tokens:.2e}",
                    f"goal ratio <= {1 + goal:.2f}: {met}; final loss = mean of the last {args.tail} steps; "
                    + (f"val ratio {val_ratio:.4f} on {args.eval_batches} batches; " if val_ratio else "")
                    + (
                        f"outer_lr {outer.outer_lr:g}, outer momentum {outer.outer_momentum:g}; "
                        if mode != "gradients"
                        else ""
                    )
                    + f"{moved / 1e6:.1f} MB averaged over {params:,} parameters; "
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
