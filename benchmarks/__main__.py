"""Benchmarks: `python -m benchmarks [--results PATH] NAME [options]`. Each appends rows to
benchmarks/results.md (or to PATH)."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from pathlib import Path

# Only the benchmark that runs is imported: importing a module can fix process-wide state for good
# (the wire benchmark must set USE_LEGACY_BFLOAT16 before anything imports hivemind).
BENCHMARKS = {
    "averaging": "S stages x R replicas (averaged) vs the reference trainer: loss",
    "chaos": "kills, restarts and freezes while a swarm trains: nothing lost, loss vs undisturbed",
    "coordinator": "the coordinator's REST API with 1,000 peer records",
    "dashboard": "the dashboard in chromium with 1,000 peer records: script time per update",
    "data": "the streaming loader on 1 GB of text files: tokens/s and memory vs the reference trainer",
    "failover": "2 peers per stage, one killed: tokens/s before and after, recovery time",
    "fuzz": "random and mutated requests to the stage service and the REST API",
    "local": "the reference trainer: tokens/s and memory",
    "outer": "DiLoCo's outer step alone, R whole-model replicas in one process, over seeds: loss vs the reference",
    "pipeline": "2 stage workers + trainer vs the reference trainer: tokens/s",
    "rebalance": "peers of different speeds find the balanced assignment",
    "simulate": "1,000 simulated peers with churn, decided by the real policies: throughput vs an oracle",
    "trainers": "one vs two trainers on one swarm, disjoint shards: samples/s",
    "scale": "real model sizes: reference trainer vs a 2-stage swarm, tokens/s, MFU, peak memory, loss",
    "verify": "spot checks: a liar's effect on loss, and the checks' overhead",
    "wan": "2 x 2 swarm on an emulated internet at 1000/100/20 Mbit/s, and relayed vs direct",
    "wire": "Forward and Backward round trips, ours vs hivemind RemoteExpert",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__,
        epilog="benchmarks:\n" + "\n".join(f"  {name:<12} {text}" for name, text in BENCHMARKS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--results", type=Path, default=None, help="write rows here instead of benchmarks/results.md")
    parser.add_argument("name", choices=sorted(BENCHMARKS), metavar="NAME", help="which benchmark (see below)")
    parser.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's own options (NAME --help)")
    top = parser.parse_args(argv)

    module = importlib.import_module(f"benchmarks.{top.name}")
    sub = argparse.ArgumentParser(prog=f"python -m benchmarks {top.name}", description=module.__doc__)
    module.add_arguments(sub)
    args = sub.parse_args(top.options)
    if top.results is not None:
        from benchmarks import results

        results.write_to(top.results)
    # SIGTERM (e.g. from `timeout`) ends the run like Ctrl-C: the `finally` blocks stop the swarm
    # processes, which live in their own process groups and would otherwise be left running.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    row = module.run(args)
    from benchmarks.results import target

    print(f"appended to {target()}:\n{row}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
