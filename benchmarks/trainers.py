"""`python -m benchmarks trainers`: one trainer vs two trainers on the same swarm, samples/s.

A coordinator of the config (configs/tiny.toml, cut into `--stages` stages, 2 by default; the embedded
corpus's 8 shards; eval off) and `--replicas` peers per stage, one by default (`swarm peer
--coordinator URL --stage K --threads 1 --delay-per-sample D_K`). The delays stand in for slow
devices and leave the peers room for a second trainer: one trainer keeps at most `accumulation`
microbatches in flight, which go forward through every stage (the last does forward and backward in
one call) and backward through all but the last before its next step starts. With a delay of d per
call on every stage but the last and 2d on the last, every peer is busy 2d per sample, and alone a
trainer keeps each busy 1/S of its step (S stages): a second trainer has room. The row's ceiling is
what the delays allow, replicas / (the busiest peer's delay per sample: 2d, or 2d on the last
stage), over one trainer's rate: how much room there was (with 2 stages the peers' delays alone
fill their time at about 2x, so 1.8x needs them busy 90% of the time; with more stages there is
more room). It leaves out what each step costs besides the samples (the stages' norm exchange,
averaging between replicas), which two trainers pay twice as often; `--averaging int8/diloco10` has the
replicas average every 10th step only (DiLoCo), so that with `--replicas 2` a step costs no all-reduce.
Then `swarm train --coordinator
URL --steps N` once alone, and twice at once; the trainers lease disjoint shards from the coordinator
(`--log-windows` names the windows each trained).

- samples/s of one trainer: (samples at its last step - samples at step `--warmup`) / the time between;
- samples/s of two: the two trainers' records placed on this process's clock (JsonTail: start =
  when each was seen - its elapsed_s), the samples each trained within the time both ran (after
  each one's `--warmup` steps), summed, over that time;
- ratio = two ÷ one (goal >= 1.8); windows trained twice = window ids in both trainers' logs, or twice
  in one.
"""

from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path

from benchmarks.averaging import LOOPBACK_MATCHMAKING_S, variant
from benchmarks.common import (
    JsonTail,
    Proc,
    averaging_spec,
    log_dir,
    read_jsonl,
    spec_name,
    start_coordinator,
    start_peer,
    stop_all,
    wait_online,
    without_eval,
)
from benchmarks.results import append_row
from swarm.config import dump_config, load_config

SECTION = "trainers: one vs two trainers on one swarm (disjoint shards leased from the coordinator)"
GOAL = 1.8


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="configs/tiny.toml", help="a run config")
    p.add_argument("--stages", type=int, default=2, help="stages to cut its model into, one peer each")
    p.add_argument("--steps", type=int, default=60, help="steps of each trainer")
    p.add_argument("--warmup", type=int, default=5, help="steps of each trainer left out of its rate")
    p.add_argument(
        "--delays", default="0.05,0.1", help="seconds per sample added by the peer of each stage (stage 0 first)"
    )
    p.add_argument("--replicas", type=int, default=1, help="peers per stage")
    p.add_argument(
        "--averaging",
        type=lambda text: spec_name(averaging_spec(text)),
        default=None,
        help="how the replicas of a stage average, as benchmarks name it (benchmarks/common.py `averaging_spec`), "
        "e.g. int8/diloco10 (a step then costs no all-reduce but every 10th); default: the config's",
    )
    p.add_argument("--inflight", type=int, default=4)
    p.add_argument(
        "--delayed-updates",
        action="store_true",
        help="the trainers send a step's microbatches while the previous step's finish (spot checks off)",
    )
    p.add_argument("--timeout-s", type=float, default=600.0, help="give up when a phase runs longer than this")
    p.add_argument("--log-dir", default=None, help="where the logs go (default: a new /tmp/swarm-trainers-* dir)")


def train(url: str, name: str, steps: int, inflight: int, tmp: Path, delayed: bool = False) -> Proc:
    args = ["train", "--coordinator", url, "--steps", str(steps), "--inflight", str(inflight)]
    if delayed:
        args += ["--delayed-updates", "--verify-fraction", "0"]
    args += ["--log-json", str(tmp / f"{name}.jsonl"), "--log-windows", str(tmp / f"{name}.windows")]
    return Proc(args, tmp / f"{name}.log")


def finish(trainers: dict[str, Proc], tmp: Path, timeout_s: float) -> dict[str, list[tuple[float, dict]]]:
    """Wait for the trainers to end; each one's records with the time (this process's clock) of each."""
    tails = {name: JsonTail(tmp / f"{name}.jsonl") for name in trainers}
    deadline = time.monotonic() + timeout_s
    while any(p.popen.poll() is None for p in trainers.values()):
        for tail in tails.values():
            tail.poll()
        if time.monotonic() > deadline:
            raise RuntimeError(f"the trainers ran past {timeout_s:.0f} s")
        time.sleep(0.05)
    for name, proc in trainers.items():
        if proc.popen.returncode != 0:
            raise RuntimeError(f"trainer {name} exited with {proc.popen.returncode}:\n{proc.output()[-3000:]}")
    out = {}
    for name, tail in tails.items():
        tail.poll()
        start = tail.start()
        out[name] = [(start + r["elapsed_s"], r) for r in tail.records]
    return out


def samples_per_s(runs: dict[str, list[tuple[float, dict]]], warmup: int, seq_len: int) -> tuple[float, float]:
    """All trainers' samples per second within the time every one of them ran past its warm-up; and that time."""
    begin = max(records[warmup][0] for records in runs.values())
    end = min(records[-1][0] for records in runs.values())
    if end <= begin:
        raise RuntimeError("the trainers did not run at the same time after their warm-up: raise --steps")
    samples = 0.0
    for records in runs.values():
        inside = [r["tokens"] for t, r in records if begin <= t <= end]
        before = [r["tokens"] for t, r in records if t < begin]
        samples += (inside[-1] - (before[-1] if before else inside[0])) / seq_len if inside else 0.0
    return samples / (end - begin), end - begin


def trained_twice(paths: list[Path]) -> int:
    counts = collections.Counter(tuple(w) for path in paths for line in read_jsonl(path) for w in line["ids"])
    return sum(n - 1 for n in counts.values() if n > 1)


def run(args: argparse.Namespace) -> str:
    delays = [float(d) for d in args.delays.split(",")]
    if len(delays) != args.stages:
        raise SystemExit(f"--delays {args.delays}: one delay per stage ({args.stages})")
    if args.steps <= args.warmup + 1:
        raise SystemExit(f"--steps {args.steps}: needs more than --warmup + 1 ({args.warmup + 1})")
    tmp = log_dir(args.log_dir, "trainers")
    config, load_avg = without_eval(args.config, tmp, "trainers")
    if args.averaging is not None:
        config.write_text(variant(config, load_config(config).wire.codec, args.averaging, LOOPBACK_MATCHMAKING_S))
    cfg = load_config(config).with_stages(args.stages)
    config.write_text(dump_config(cfg))

    procs: list[Proc] = []
    try:
        coordinator, url = start_coordinator(config, tmp / "coordinator.log")
        procs.append(coordinator)
        peers = {}
        for k, delay in enumerate(delays):
            for r in range(args.replicas):
                name = f"p{k}" + (f"r{r}" if args.replicas > 1 else "")
                peers[name] = start_peer(url, name, k, tmp, "--no-rebalance", "--delay-per-sample", str(delay))
                procs.append(peers[name])
        wait_online(url, peers)

        alone = {"solo": train(url, "solo", args.steps, args.inflight, tmp, args.delayed_updates)}
        procs += alone.values()
        one, one_s = samples_per_s(finish(alone, tmp, args.timeout_s), args.warmup, cfg.model.seq_len)
        print(f"one trainer: {one:.1f} samples/s over {one_s:.1f} s", flush=True)

        pair = {name: train(url, name, args.steps, args.inflight, tmp, args.delayed_updates) for name in ("a", "b")}
        procs += pair.values()
        two, two_s = samples_per_s(finish(pair, tmp, args.timeout_s), args.warmup, cfg.model.seq_len)
        print(f"two trainers: {two:.1f} samples/s over {two_s:.1f} s", flush=True)
    finally:
        stop_all(procs)
    twice = trained_twice([tmp / "a.windows", tmp / "b.windows"])
    ratio = two / one
    # Seconds of delay per sample on each peer: forward and backward on every stage but the last, one
    # call on the last.
    busy = [2 * d for d in delays[:-1]] + [delays[-1]]
    ceiling = args.replicas / max(busy) / one if max(busy) > 0 else float("inf")
    print(f"ratio {ratio:.2f} (goal >= {GOAL}); windows trained twice by the pair: {twice}", flush=True)
    acc = cfg.training.accumulation
    return append_row(
        SECTION,
        ["config", "peer delays s/sample", "steps", "samples/s 1 trainer", "samples/s 2 trainers", "ratio", "notes"],
        [
            f"{args.config}, {args.stages} stages",
            args.delays,
            args.steps,
            f"{one:.1f}",
            f"{two:.1f}",
            f"{ratio:.2f}",
            f"goal >= {GOAL}: {'met' if ratio >= GOAL else 'not met'}; ceiling from the peers' delays "
            f"{ceiling:.2f}x one trainer; {args.replicas} peer(s) per stage, {acc} microbatches of "
            f"{cfg.training.micro_batch} per step, {args.inflight} in flight"
            f"{f', averaging {args.averaging}' if args.averaging else ''}"
            f"{', delayed updates (spot checks off)' if args.delayed_updates else ''}; "
            f"rates after {args.warmup} steps of each "
            f"trainer ({one_s:.0f} s alone, {two_s:.0f} s together); windows trained twice: {twice}; eval off; "
            f"1 torch thread per peer; load avg {load_avg:.1f} at start",
        ],
    )
