"""The `swarm` command line: one entry point, one subcommand per role."""

from __future__ import annotations

import argparse
import sys

from coordinator import cli as coordinator_cli
from peer import cli as peer_cli
from swarm import demo_cli, export_cli, tokenizer_cli
from swarm.config import ConfigError
from swarm.logs import LEVELS, setup_logging
from swarm.trainer import cli as trainer_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarm", description="Train one transformer on a swarm of volunteer GPUs.")
    from swarm import __version__

    parser.add_argument("--version", action="version", version=f"swarm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    commands = [
        *trainer_cli.add_commands(sub),
        *peer_cli.add_commands(sub),
        *coordinator_cli.add_commands(sub),
        *export_cli.add_commands(sub),
        *tokenizer_cli.add_commands(sub),
        *demo_cli.add_commands(sub),
    ]
    for command in commands:
        command.add_argument(
            "--log-level",
            choices=LEVELS,
            default="info",
            help="the least severe log lines shown on stderr (default: info)",
        )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
