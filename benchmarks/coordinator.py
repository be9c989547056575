"""`python -m benchmarks coordinator`: how fast the coordinator answers /api/v1/state and /metrics for a big swarm.

A real coordinator (`swarm coordinator`) of the config with `--stages` stages, and `--peers` peer
records stored into its DHT (benchmarks/crowd.py). Once /api/v1/state lists every peer, `--requests`
sequential GETs of /api/v1/state, then as many of /metrics, go through one keep-alive HTTP client;
each is timed from the request to the last byte of the body.

Reported: p50 and p99 latency of each endpoint (ms), the state's size, and the seconds from the
first store until the state listed every peer (the coordinator re-reads the DHT every READ_EVERY_S).
Goal: p99 <= --goal-ms for both endpoints.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import httpx

from benchmarks.common import log_dir
from benchmarks.crowd import add_crowd_arguments, crowded_coordinator
from benchmarks.results import append_row
from coordinator.run import READ_EVERY_S

SECTION = "coordinator: /api/v1/state and /metrics latency with many peers in the DHT"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_crowd_arguments(p)
    p.add_argument("--requests", type=int, default=200, help="GETs of each endpoint")
    p.add_argument("--goal-ms", type=float, default=200.0)


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def timed_gets(client: httpx.Client, url: str, n: int) -> tuple[list[float], int]:
    """Milliseconds of each of `n` GETs, and the size of the last body."""
    times, size = [], 0
    for _ in range(n):
        start = time.perf_counter()
        response = client.get(url)
        size = len(response.content)
        times.append((time.perf_counter() - start) * 1000)
        response.raise_for_status()
    return times, size


def run(args: argparse.Namespace) -> str:
    tmp = log_dir(args.log_dir, "coordinator")
    with crowded_coordinator(args.config, args.stages, args.peers, tmp, args.timeout_s) as (url, _, visible_s):
        print(f"/api/v1/state lists all {args.peers} peers after {visible_s:.1f} s", flush=True)
        with httpx.Client(timeout=30) as client:
            load = os.getloadavg()[0]
            state_ms, state_bytes = timed_gets(client, f"{url}/api/v1/state", args.requests)
            metrics_ms, _ = timed_gets(client, f"{url}/metrics", args.requests)

    p50s, p99s = percentile(state_ms, 50), percentile(state_ms, 99)
    p50m, p99m = percentile(metrics_ms, 50), percentile(metrics_ms, 99)
    met = "met" if max(p99s, p99m) <= args.goal_ms else "not met"
    print(f"/api/v1/state p50 {p50s:.1f} p99 {p99s:.1f} ms; /metrics p50 {p50m:.1f} p99 {p99m:.1f} ms", flush=True)
    return append_row(
        SECTION,
        [
            "config",
            "stages",
            "peers",
            "requests",
            "state p50 ms",
            "state p99 ms",
            "state size",
            "metrics p50 ms",
            "metrics p99 ms",
            "listed after s",
            "notes",
        ],
        [
            args.config,
            args.stages,
            args.peers,
            args.requests,
            f"{p50s:.1f}",
            f"{p99s:.1f}",
            f"{state_bytes / 1024:.0f} KiB",
            f"{p50m:.1f}",
            f"{p99m:.1f}",
            f"{visible_s:.1f}",
            f"goal p99 <= {args.goal_ms:g} ms: {met}; sequential GETs over one keep-alive connection from the "
            f"same machine, the coordinator re-reading the DHT every {READ_EVERY_S:g} s meanwhile; "
            f"load avg {load:.1f} at start",
        ],
    )
