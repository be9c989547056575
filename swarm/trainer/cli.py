"""`swarm train`: its arguments and what it runs (the trainer itself is imported only when it runs)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Iterator

from swarm.arguments import (
    add_join_token,
    add_join_wait,
    coordinator_url,
    data_path,
    fraction,
    non_negative_int,
    positive_int,
)
from swarm.config import ConfigError, load_config


def add_commands(commands: argparse._SubParsersAction) -> list[argparse.ArgumentParser]:
    """Add `swarm train` to `commands`; the parsers it made."""
    train = commands.add_parser(
        "train",
        help="train the model (--local: reference trainer in one process)",
        description="Train the model. --local runs the whole model in this process.",
    )
    train.add_argument("--local", action="store_true", help="train the whole model in this process")
    train.add_argument("--config", help="run configuration (TOML), e.g. configs/tiny.toml")
    train.add_argument("--steps", type=positive_int, help="optimizer steps to run (default: training.steps)")
    train.add_argument("--log-json", metavar="PATH", help="write one JSON object per optimizer step to PATH")
    train.add_argument("--log-windows", metavar="PATH", help=argparse.SUPPRESS)  # the windows each microbatch trained
    train.add_argument("--device", help="auto (default), cpu, cuda or cuda:N")
    train.add_argument("--peers", metavar="ADDR0,ADDR1,...", help="one stage worker per stage, in stage order")
    train.add_argument("--inflight", type=positive_int, default=4, help="microbatches in flight at once (default 4)")
    train.add_argument(
        "--delayed-updates",
        action="store_true",
        help="with --peers or --coordinator: send a step's microbatches while the previous step's finish, "
        "their gradients up to one step stale (SWARM's delayed parameter updates); with --coordinator, "
        "spot checks off (--verify-fraction 0)",
    )
    train.add_argument(
        "--coordinator",
        metavar="URL",
        help="train through the swarm of this run's coordinator (default: $SWARM_COORDINATOR)",
    )
    train.add_argument(
        "--data", type=data_path, metavar="PATH", help="train on these text files (file or folder), not the run's data"
    )
    train.add_argument(
        "--allow-config-files",
        action="store_true",
        help="with --coordinator: read the local files the run's data section names (by default a trainer "
        "reads local files only from its own --data)",
    )
    train.add_argument("--call-timeout", type=float, default=60.0, help="seconds before a call is retried elsewhere")
    train.add_argument(
        "--verify-fraction",
        type=fraction,
        metavar="F",
        help="with --coordinator: share of forward calls spot-checked on a second peer (default: the run's "
        "verify.fraction; 0 disables)",
    )
    add_join_token(train, "the run's join token, if it has one (with --peers: the stage workers')")
    add_join_wait(train)
    # Faults for tests (swarm/trainer/options.py: TrainerFaults), hidden from --help.
    train.add_argument("--start-step", type=non_negative_int, default=None, help=argparse.SUPPRESS)
    train.set_defaults(func=cmd_train)
    return [train]


def stop_on_signals() -> None:
    """SIGINT and SIGTERM stop this process as Ctrl-C does (KeyboardInterrupt: a trainer's calls end,
    its DHT node and leases are let go), even when it was started with SIGINT ignored (a background
    job of a non-interactive shell). Processes forked from it (hivemind's DHT) keep the default
    action, so that a signal to the process group ends them at once rather than with a traceback."""
    main = os.getpid()

    def stop(signum: int, frame) -> None:
        if os.getpid() == main:
            raise KeyboardInterrupt
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)


@contextlib.contextmanager
def run_failed_is_an_error() -> Iterator[None]:
    """A trainer's `RunFailed` ends the command with its one line and exit status 1, no traceback."""
    from swarm.trainer.caller import RunFailed

    try:
        yield
    except RunFailed as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(1) from None


def cmd_train(args: argparse.Namespace) -> int:
    from swarm.trainer.options import TrainerFaults, TrainerOptions

    stop_on_signals()

    args.coordinator = coordinator_url(args.coordinator, bool(args.local or args.peers or args.config))
    opts = TrainerOptions(
        steps=args.steps,
        inflight=args.inflight,
        delayed_updates=args.delayed_updates,
        log_json=args.log_json,
        log_windows=args.log_windows,
        device=args.device,
        data=args.data,
        allow_config_files=args.allow_config_files,
        call_timeout=args.call_timeout,
        verify_fraction=args.verify_fraction,
        join_token=args.join_token,
        join_wait=args.join_wait,
        faults=TrainerFaults(start_step=args.start_step),
    )
    if args.coordinator:
        if args.local or args.peers or args.config:
            raise ConfigError(
                "swarm train: --coordinator takes the run config from the coordinator; "
                "drop --local, --peers and --config"
            )
        from swarm.trainer.swarm import train_swarm

        with run_failed_is_an_error():
            train_swarm(args.coordinator, opts)
        return 0
    if not args.config:
        raise ConfigError("swarm train: --config is required (or --coordinator URL, or $SWARM_COORDINATOR)")
    run = load_config(args.config)
    if opts.data:
        run = run.with_data(opts.data)
    if args.local:
        if opts.delayed_updates:
            raise ConfigError("swarm train: --delayed-updates is for --peers or --coordinator (--local has no stages)")
        from swarm.trainer.local import train_local

        train_local(run, opts.steps or run.training.steps, device=opts.device, log_json=opts.log_json)
        return 0
    if args.peers:
        from swarm.trainer.pipeline import train_pipeline

        addresses = [a.strip() for a in args.peers.split(",") if a.strip()]
        for a in addresses:
            host, _, port = a.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(f"--peers: {a!r} is not HOST:PORT")
        with run_failed_is_an_error():
            train_pipeline(run, addresses, opts)
        return 0
    raise ConfigError("swarm train: choose where to train: --local (one process) or --peers ADDR0,ADDR1,...")
