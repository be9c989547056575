"""`python -m benchmarks verify`: spot checks: a peer corrupting its outputs, banned; their cost in tokens/s.

Four runs of the same swarm, each from the seeded init with the same steps and data order: a
coordinator of the config (configs/tiny.toml: 2 stages, averaging on loopback), one peer of
stage 0 and three of stage 1 (`swarm peer --coordinator URL --stage K --no-rebalance --threads 1`),
one trainer (`swarm train --coordinator URL --steps N --verify-fraction F --log-json P`):

- honest, checks on: three honest peers on stage 1, `--fraction` of forward calls spot-checked;
- honest, checks off: the same, `--verify-fraction 0`;
- corrupted, checks on: one of the three started with `--corrupt-outputs SCALE` (Gaussian noise of
  SCALE x the outputs' RMS on every forward output), checks at `--fraction`;
- corrupted, checks off: the same liar, `--verify-fraction 0` (what the checks prevent;
  `--no-unchecked-liar` leaves this run out, and its column reads "-").

Definitions:
- final loss = mean training loss of the last `--tail` steps; loss ratio = a run's final loss /
  the honest run's with checks on; the goal is within 3% for the corrupted run with checks on;
- microbatches until the ban = the trainer's count of training microbatches up to and including
  the one whose check banned the liar (from its "spot check: banned peer" line);
- microbatches lost / applied twice (benchmarks/ledger.py): training microbatches a run's trainer
  sent whose gradient no optimizer step of some stage applied (peers started with `--log-steps`),
  or that one stage applied twice; summed over every run (a banned liar's gradients stay applied:
  an inner stage adds none at its forward, the last stage's forward is its backward);
- tokens/s = the trainer's tokens / elapsed of its last step (the whole run);
  overhead = 1 - median(honest, checks on) / median(honest, checks off) over `--repeat` pairs of
  honest runs, on and off in turn (one run's tokens/s moves by several % from run to run).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
from pathlib import Path

from benchmarks import ledger
from benchmarks.common import (
    Proc,
    final_loss,
    log_dir,
    read_step_logs,
    run_to_end,
    start_coordinator,
    start_peer,
    stop_all,
    wait_online,
)
from benchmarks.results import append_row
from swarm.config import load_config

# The table before this one (the same title without "lost from the step logs") counted no microbatches.
SECTION = "verify: spot checks against a peer corrupting its outputs (1 + 3 peers); lost from the step logs"
BAN = re.compile(r"spot check: banned peer (\S+) of stage (\d+) at microbatch (\d+)\.(\d+)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="configs/tiny.toml", help="a 2-stage run config")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--fraction", type=float, default=0.02, help="share of forward calls spot-checked")
    p.add_argument("--scale", type=float, default=0.5, help="the liar's noise, x the RMS of its outputs")
    p.add_argument("--matchmaking", type=float, default=0.5, help="averaging.matchmaking_time_s (loopback)")
    p.add_argument("--tail", type=int, default=10, help="steps averaged into the final loss")
    p.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="pairs of honest runs (checks on, off) for the overhead; 0: one honest run with checks on (the losses' "
        "reference), overhead not measured",
    )
    p.add_argument(
        "--unchecked-liar",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the liar with checks off too (what the checks prevent); --no-unchecked-liar: one swarm fewer, "
        "for a quick run that still bans the liar",
    )
    p.add_argument("--log-dir", default=None)


def run_swarm(
    config: Path, steps: int, fraction: float, liar_scale: float, tmp: Path
) -> tuple[list[dict], str, ledger.Ledger]:
    """One run; returns the trainer's --log-json records, its output, and the ledger of its microbatches."""
    procs: list[Proc] = []
    peers: dict[str, Proc] = {}
    try:
        coordinator, url = start_coordinator(config, tmp / "coordinator.log")
        procs.append(coordinator)

        def peer(name: str, stage: int, host: str, *extra: str) -> Proc:
            return start_peer(
                url, name, stage, tmp, "--no-rebalance", "--log-steps", str(tmp / f"{name}.steps"), *extra, host=host
            )

        peers["s0"] = peer("s0", 0, "127.0.0.2")
        for n, name in enumerate(("honest1", "honest2", "liar" if liar_scale else "honest3")):
            extra = ["--corrupt-outputs", str(liar_scale)] if name == "liar" else []
            # Each on a machine of its own (a loopback address): checks count one vote per host.
            peers[name] = peer(name, 1, f"127.0.0.{3 + n}", *extra)
        procs += peers.values()
        wait_online(url, peers)
        log_json = tmp / "train.jsonl"
        args = ["train", "--coordinator", url, "--steps", str(steps), "--verify-fraction", str(fraction)]
        out = run_to_end([*args, "--log-json", str(log_json)], tmp / "trainer.log", procs)
        print(out[out.rfind("summary") :], flush=True)
        records = [json.loads(line) for line in log_json.read_text().splitlines() if line.strip()]
    finally:
        stop_all(procs)
    # Read once every peer has stopped: a step being averaged at the end is in its log by then.
    steps_logged = read_step_logs({name: tmp / f"{name}.steps" for name in peers})
    return records, out, ledger.count(records, steps_logged, 2)


def run(args: argparse.Namespace) -> str:
    cfg = load_config(args.config)
    if cfg.stages.count != 2:
        raise SystemExit(f"{args.config}: the verify benchmark expects a 2-stage config, not {cfg.stages.count}")
    if args.repeat < 0:
        raise SystemExit(f"--repeat must be >= 0, got {args.repeat}")
    acc = cfg.training.accumulation
    tmp = log_dir(args.log_dir, "verify")
    config = tmp / "run.toml"
    text = Path(args.config).read_text()
    if "[averaging]" not in text:
        m = args.matchmaking
        text += f"\n[averaging]\nmatchmaking_time_s = {m}\nrequest_timeout_s = {m * 0.6:g}\n"
    config.write_text(text)
    load_config(config)
    load_avg = os.getloadavg()[0]

    runs = {
        "honest, checks on": (args.fraction, 0.0),
        "honest, checks off": (0.0, 0.0),
        "corrupted, checks on": (args.fraction, args.scale),
        "corrupted, checks off": (0.0, args.scale),
    }
    if not args.unchecked_liar:
        del runs["corrupted, checks off"]
    honest = [label for _ in range(args.repeat) for label in list(runs)[:2]] or list(runs)[:1]
    order = honest + list(runs)[2:]
    results: dict[str, tuple[list[dict], str]] = {}
    speeds: dict[str, list[float]] = {label: [] for label in runs if label in order}
    honest_bans = 0  # over every honest run
    sent = lost = twice = 0  # over every run
    for i, label in enumerate(order):
        fraction, scale = runs[label]
        run_dir = tmp / f"{i}-{label.replace(', ', '-').replace(' ', '-')}"
        run_dir.mkdir(exist_ok=True)
        print(f"run {i + 1}/{len(order)}, {label}: --verify-fraction {fraction}, liar {scale or 'none'}", flush=True)
        records, out, counted = run_swarm(config, args.steps, fraction, scale, run_dir)
        sent, lost, twice = sent + counted.sent, lost + counted.lost, twice + counted.applied_twice
        print("\n".join(f"  {k}: {v}" for k, v in counted.summary().items()), flush=True)
        results.setdefault(label, (records, out))  # the first run of each kind for the losses
        speeds[label].append(records[-1]["tokens_per_s"])
        if label.startswith("honest"):
            honest_bans += len(BAN.findall(out))

    loss = {label: final_loss(records, args.tail) for label, (records, _) in results.items()}
    tps = {label: statistics.median(v) for label, v in speeds.items()}
    base = loss["honest, checks on"]
    ratio = loss["corrupted, checks on"] / base
    ratio_off = f"{loss['corrupted, checks off'] / base:.4f}" if "corrupted, checks off" in loss else "-"
    off = tps.get("honest, checks off")
    overhead = f"{1 - tps['honest, checks on'] / off:.1%}" if off else "not measured (--repeat 0)"
    honest_speeds = {label: v for label, v in speeds.items() if label.startswith("honest")}
    spread = "; ".join(f"{label}: {', '.join(f'{v:,.0f}' for v in values)}" for label, values in honest_speeds.items())
    records, out = results["corrupted, checks on"]
    bans = BAN.findall(out)
    banned_after = int(bans[0][2]) * acc + int(bans[0][3]) + 1 if bans else None
    checks = {label: records[-1].get("spot_checks", 0) for label, (records, _) in results.items()}

    print("\nsummary", flush=True)
    rows = {
        "config": f"{args.config}, {args.steps} steps x {acc} microbatches, 1 + 3 peers",
        **{f"final loss, {label}": f"{v:.4f} ({tps[label]:,.0f} tokens/s)" for label, v in loss.items()},
        "corrupted ÷ honest, checks on": f"{ratio:.4f}",
        "corrupted ÷ honest, checks off": ratio_off,
        "microbatches until the ban": banned_after if banned_after is not None else "never banned",
        "bans in the honest runs": honest_bans,
        "microbatches lost, every run": f"{lost} of {sent} sent (applied twice: {twice})",
        "spot checks made": ", ".join(f"{label}: {n}" for label, n in checks.items()),
        f"overhead of checks at {args.fraction:g}": (
            f"{overhead} of tokens/s (medians of {args.repeat} runs)" if off else overhead
        ),
        "honest tokens/s, each run": spread,
        "logs": str(tmp),
    }
    width = max(map(len, rows))
    print("\n".join(f"  {k:<{width}}  {v}" for k, v in rows.items()), flush=True)

    goal = "met" if abs(ratio - 1) <= 0.03 and banned_after is not None and lost == twice == 0 else "not met"
    return append_row(
        SECTION,
        [
            "config",
            "steps",
            "fraction",
            "liar noise",
            "honest final loss",
            "corrupted ÷ honest, checks on",
            "corrupted ÷ honest, checks off",
            "microbatches until the ban",
            "microbatches lost",
            "applied twice",
            "honest tokens/s, checks on",
            "honest tokens/s, checks off",
            "overhead",
            "notes",
        ],
        [
            args.config,
            args.steps,
            f"{args.fraction:g}",
            f"{args.scale:g} x RMS",
            f"{base:.4f}",
            f"{ratio:.4f}",
            ratio_off,
            banned_after if banned_after is not None else "never",
            f"{lost} of {sent}",
            twice,
            f"{tps['honest, checks on']:,.0f}",
            f"{off:,.0f}" if off else "-",
            overhead,
            f"goal corrupted within 3% of honest with checks on, liar banned, none lost or twice: {goal}; "
            f"{honest_bans} bans in the "
            f"honest runs; spot checks made (checks on): honest {checks['honest, checks on']}, corrupted "
            f"{checks['corrupted, checks on']} (every call is checked until each peer passed 2 checks); final loss "
            f"= mean of the last {args.tail} steps; tokens/s over the whole run, median of {args.repeat} runs each "
            f"({spread}); matchmaking {args.matchmaking:g} s, loopback, 1 torch thread per peer; load avg "
            f"{load_avg:.1f} at start",
        ],
    )
