"""The `swarm` command line: one entry point, one subcommand per role."""

from __future__ import annotations

import argparse
import sys

from swarm.config import ConfigError, load_config


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def cmd_train(args: argparse.Namespace) -> int:
    run = load_config(args.config)
    steps = args.steps or run.training.steps
    if args.local:
        from swarm.train_local import train_local

        train_local(run, steps, device=args.device, log_json=args.log_json)
        return 0
    raise ConfigError("swarm train: choose where to train: --local (one process)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarm", description="Train one transformer on a swarm of volunteer GPUs.")
    from swarm import __version__

    parser.add_argument("--version", action="version", version=f"swarm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = sub.add_parser(
        "train",
        help="train the model (--local: reference trainer in one process)",
        description="Train the model. --local runs the whole model in this process.",
    )
    train.add_argument("--local", action="store_true", help="train the whole model in this process")
    train.add_argument("--config", required=True, help="run configuration (TOML), e.g. configs/tiny.toml")
    train.add_argument("--steps", type=positive_int, help="optimizer steps to run (default: training.steps)")
    train.add_argument("--log-json", metavar="PATH", help="write one JSON object per optimizer step to PATH")
    train.add_argument("--device", help="auto (default), cpu, cuda or cuda:N")
    train.set_defaults(func=cmd_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
