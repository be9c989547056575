"""`swarm demo`: its arguments and what it runs (swarm/demo.py is imported only when it runs)."""

from __future__ import annotations

import argparse
from pathlib import Path

from swarm.arguments import port_number, positive_int
from swarm.config import ConfigError


def add_commands(commands: argparse._SubParsersAction) -> list[argparse.ArgumentParser]:
    """Add `swarm demo` to `commands`; the parsers it made."""
    demo = commands.add_parser(
        "demo",
        help="the whole swarm on this machine: coordinator, peers, trainer, export, sample",
        description="Run a coordinator, STAGES x REPLICAS peers and a trainer on this machine as child processes, "
        "follow the run on one progress bar, export the model, print a sample and a summary, stop every child.",
    )
    demo.add_argument("--config", type=Path, help="run configuration (default: the embedded demo run)")
    demo.add_argument("--stages", type=positive_int, help="pipeline stages (default: the config's stages.count)")
    demo.add_argument("--replicas", type=positive_int, default=1, help="peers per stage (default 1)")
    demo.add_argument("--steps", type=positive_int, help="optimizer steps (default: the config's training.steps)")
    demo.add_argument("--port", type=port_number, default=8000, help="the dashboard's port (default 8000)")
    demo.add_argument(
        "--workdir", type=Path, default=Path("swarm-demo"), help="logs, state and the export (default ./swarm-demo)"
    )
    demo.add_argument("--prompt", default="The ", help="start of the sample drawn from the exported model")
    demo.set_defaults(func=cmd_demo)
    return [demo]


def cmd_demo(args: argparse.Namespace) -> int:
    from swarm.demo import DemoOptions, run_demo

    if args.port == 0:
        raise ConfigError("--port: give a port for the dashboard (0 picks none)")
    opts = DemoOptions(
        config=args.config,
        stages=args.stages,
        replicas=args.replicas,
        steps=args.steps,
        port=args.port,
        workdir=args.workdir,
        prompt=args.prompt,
    )
    return run_demo(opts)
