"""`python -m benchmarks rebalance`: seconds for an imbalanced swarm to balance, and how close to the best.

A coordinator of the config with `rebalance.period_s = --period`, and one `swarm peer --stage K
--delay-per-sample D --threads 1` per entry of `--delays` / `--start` (the delay stands in for a
slower device: it lowers the throughput the peer measures and announces). No trainer runs, so the
announced throughputs stay put and the policy sees the same numbers throughout.

Definitions (throughputs as the peers announce them, read from the coordinator's /api/v1/state):
- min-stage throughput = the lowest per-stage total of online peers' throughputs;
- before = at the start (every peer online on its start stage);
- optimum = the best min-stage throughput over every assignment of the peers to stages (brute force);
- seconds to balance = from the start until min-stage throughput first reaches `--goal` x optimum
  with every peer online;
- after = min-stage throughput `--hold` periods later (no peer may move in that time: thrash is
  counted in `moves after balance`).
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

from benchmarks.common import Proc, http, log_dir, start_coordinator, start_peer, stop_all, wait_online
from benchmarks.results import append_row

SECTION = "rebalance: peers started on the wrong stages, until the swarm is balanced"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="configs/tiny.toml", help="a 2-stage run config")
    p.add_argument("--delays", default="0,0.02,0.05,0.1", help="seconds of delay per sample, one per peer")
    p.add_argument("--start", default="0,0,0,0", help="start stage of each peer")
    p.add_argument("--period", type=float, default=4.0, help="rebalance.period_s")
    p.add_argument("--goal", type=float, default=0.9, help="fraction of the optimum that counts as balanced")
    p.add_argument("--hold", type=int, default=3, help="periods to watch after balance")
    p.add_argument("--timeout-s", type=float, default=180.0)
    p.add_argument("--log-dir", default=None)


def read_state(url: str) -> dict:
    return http().get(f"{url}/api/v1/state").json()


def stage_totals(state: dict) -> list[float]:
    return [sum(p["throughput"] for p in s["peers"] if p["state"] == "online") for s in state["stages"]]


def online(state: dict) -> set[str]:
    return {p["public_name"] for s in state["stages"] for p in s["peers"] if p["state"] == "online"}


def best_min_total(speeds: list[float], stages: int) -> float:
    return max(
        min(sum(s for s, a in zip(speeds, assign, strict=True) if a == k) for k in range(stages))
        for assign in itertools.product(range(stages), repeat=len(speeds))
    )


def count_moves(peers: dict[str, Proc]) -> int:
    return sum(p.output().count("moving from stage") for p in peers.values())


def run(args: argparse.Namespace) -> str:
    delays = [float(x) for x in args.delays.split(",")]
    start = [int(x) for x in args.start.split(",")]
    if len(delays) != len(start):
        raise SystemExit(f"--delays has {len(delays)} entries, --start {len(start)}: one of each per peer")
    tmp = log_dir(args.log_dir, "rebalance")
    config = tmp / "run.toml"
    config.write_text(Path(args.config).read_text() + f"\n[rebalance]\nperiod_s = {args.period}\n")
    procs: list[Proc] = []
    peers: dict[str, Proc] = {}
    try:
        coordinator, url = start_coordinator(config, tmp / "coordinator.log")
        procs.append(coordinator)
        for i, (delay, stage) in enumerate(zip(delays, start, strict=True)):
            name = f"u{i}"
            peers[name] = start_peer(url, name, stage, tmp, "--delay-per-sample", str(delay))
            procs.append(peers[name])
        wait_online(url, peers)
        began = time.monotonic()
        state = read_state(url)
        speeds = [p["throughput"] for s in state["stages"] for p in s["peers"]]
        before = min(stage_totals(state))
        optimum = best_min_total(speeds, len(state["stages"]))
        print(f"start: stage totals {stage_totals(state)}, optimum min-stage {optimum:.1f}", flush=True)
        balanced_s = None
        while balanced_s is None:
            state = read_state(url)
            if online(state) == set(peers) and min(stage_totals(state)) >= args.goal * optimum:
                balanced_s = time.monotonic() - began
            elif time.monotonic() - began > args.timeout_s:
                raise RuntimeError(f"not balanced after {args.timeout_s:.0f} s: {stage_totals(state)}")
            time.sleep(0.25)
        moves = count_moves(peers)
        print(f"balanced after {balanced_s:.1f} s and {moves} moves: {stage_totals(state)}", flush=True)
        time.sleep(args.hold * args.period)
        state = read_state(url)
        after = min(stage_totals(state))
        thrash = count_moves(peers) - moves
    finally:
        stop_all(procs)
    return append_row(
        SECTION,
        [
            "config",
            "peers (delay s/sample → start stage)",
            "period s",
            "seconds to balance",
            "moves",
            "min-stage before",
            "min-stage after",
            "optimum",
            "after ÷ optimum",
            "moves after balance",
        ],
        [
            args.config,
            ", ".join(f"{d:g}→{s}" for d, s in zip(delays, start, strict=True)),
            f"{args.period:g}",
            f"{balanced_s:.1f}",
            moves,
            f"{before:.1f}",
            f"{after:.1f}",
            f"{optimum:.1f}",
            f"{after / optimum:.3f}",
            thrash,
        ],
    )
