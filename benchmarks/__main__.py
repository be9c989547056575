"""Benchmarks: `python -m benchmarks NAME [options]`. Each appends a row to benchmarks/results.md."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

BENCHMARKS = {
    "averaging": "benchmarks.averaging",
    "chaos": "benchmarks.chaos",
    "coordinator": "benchmarks.coordinator",
    "failover": "benchmarks.failover",
    "fuzz": "benchmarks.fuzz",
    "local": "benchmarks.local",
    "pipeline": "benchmarks.pipeline",
    "rebalance": "benchmarks.rebalance",
    "verify": "benchmarks.verify",
    "wire": "benchmarks.wire",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    sub = parser.add_subparsers(dest="name", required=True, metavar="NAME")
    modules = {}
    for name, module in BENCHMARKS.items():
        mod = importlib.import_module(module)
        modules[name] = mod
        mod.add_arguments(sub.add_parser(name, help=mod.__doc__.strip().splitlines()[0]))
    args = parser.parse_args(argv)
    # SIGTERM (e.g. from `timeout`) ends the run like Ctrl-C: the `finally` blocks stop the swarm
    # processes, which live in their own process groups and would otherwise be left running.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    row = modules[args.name].run(args)
    print(f"appended to benchmarks/results.md:\n{row}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
