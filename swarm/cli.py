"""The `swarm` command line: one entry point, one subcommand per role."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from swarm.config import ConfigError, load_config


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def non_negative_int(text: str) -> int:
    value = positive_int(text) if text.strip() != "0" else 0
    return value


def port_number(text: str) -> int:
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0..65535)")
    return value


def cmd_train(args: argparse.Namespace) -> int:
    if args.coordinator:
        if args.local or args.peers or args.config:
            raise ConfigError(
                "swarm train: --coordinator takes the run config from the coordinator; "
                "drop --local, --peers and --config"
            )
        from swarm.train_swarm import train_swarm

        train_swarm(
            args.coordinator, args.steps, inflight=args.inflight, log_json=args.log_json, call_timeout=args.call_timeout
        )
        return 0
    if not args.config:
        raise ConfigError("swarm train: --config is required (or --coordinator URL)")
    run = load_config(args.config)
    steps = args.steps or run.training.steps
    if args.local:
        from swarm.train_local import train_local

        train_local(run, steps, device=args.device, log_json=args.log_json)
        return 0
    if args.peers:
        from swarm.train_pipeline import train_pipeline

        addresses = [a.strip() for a in args.peers.split(",") if a.strip()]
        for a in addresses:
            host, _, port = a.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(f"--peers: {a!r} is not HOST:PORT")
        train_pipeline(run, addresses, steps, inflight=args.inflight, log_json=args.log_json)
        return 0
    raise ConfigError("swarm train: choose where to train: --local (one process) or --peers ADDR0,ADDR1,...")


def stage_choice(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        return non_negative_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither 'auto' nor a stage index") from None


def cmd_peer(args: argparse.Namespace) -> int:
    if args.coordinator:
        if args.config:
            raise ConfigError("swarm peer: give --coordinator (join a run) or --config (serve by hand), not both")
        from peer.daemon import exit_now, run_peer

        code = run_peer(
            args.coordinator,
            args.stage,
            args.host,
            args.port,
            device=args.device,
            public_name=args.public_name,
            threads=args.threads,
            delay_per_sample=args.delay_per_sample,
            step_log=args.log_steps,
            rebalance=not args.no_rebalance,
        )
        exit_now(code)
    if not args.config or args.stage is None:
        raise ConfigError("swarm peer: give --coordinator URL, or --config C with --stage K")
    from peer.run import serve_stage

    run = load_config(args.config)
    return serve_stage(run, args.stage, args.host, args.port, device=args.device, threads=args.threads)


def cmd_coordinator(args: argparse.Namespace) -> int:
    from coordinator.run import serve_coordinator

    run = load_config(args.config)
    state_dir = args.state_dir or Path("swarm-state") / run.run_id
    token = args.token or os.environ.get("SWARM_TOKEN") or None
    return serve_coordinator(
        run, host=args.host, port=args.port, dht_port=args.dht_port, state_dir=state_dir, token=token
    )


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
    train.add_argument("--config", help="run configuration (TOML), e.g. configs/tiny.toml")
    train.add_argument("--steps", type=positive_int, help="optimizer steps to run (default: training.steps)")
    train.add_argument("--log-json", metavar="PATH", help="write one JSON object per optimizer step to PATH")
    train.add_argument("--device", help="auto (default), cpu, cuda or cuda:N")
    train.add_argument("--peers", metavar="ADDR0,ADDR1,...", help="one stage worker per stage, in stage order")
    train.add_argument("--inflight", type=positive_int, default=4, help="microbatches in flight at once (default 4)")
    train.add_argument("--coordinator", metavar="URL", help="train through the swarm of this run's coordinator")
    train.add_argument("--call-timeout", type=float, default=60.0, help="seconds before a call is retried elsewhere")
    train.set_defaults(func=cmd_train)

    peer = sub.add_parser(
        "peer",
        help="join a run as a peer (or serve one stage by hand)",
        description="Join a run through its coordinator and serve a stage until SIGTERM or Ctrl-C; "
        "or, with --config and --stage, serve one stage by hand.",
    )
    peer.add_argument("--coordinator", metavar="URL", help="the run's coordinator, e.g. http://host:8000")
    peer.add_argument("--config", help="run configuration (TOML), to serve a stage by hand")
    peer.add_argument(
        "--stage",
        type=stage_choice,
        default=None,
        help="stage index, or 'auto' (default with --coordinator): the least served stage",
    )
    peer.add_argument("--public-name", default="", help="name shown on the dashboard")
    peer.add_argument("--no-rebalance", action="store_true", help="stay on the first stage (never move)")
    peer.add_argument("--delay-per-sample", type=float, default=0.0, help=argparse.SUPPRESS)  # tests: a slow device
    peer.add_argument("--log-steps", type=Path, default=None, help=argparse.SUPPRESS)  # tests: applied microbatches
    peer.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    peer.add_argument("--port", type=port_number, default=0, help="port to listen on (default: any free port)")
    peer.add_argument("--device", help="auto (default), cpu, cuda or cuda:N")
    peer.add_argument("--threads", type=positive_int, help="torch CPU threads (default: torch's choice)")
    peer.set_defaults(func=cmd_peer)

    coord = sub.add_parser(
        "coordinator",
        help="bootstrap DHT node, REST API and dashboard of a run",
        description="Start the run's first DHT node and serve its REST API.",
    )
    coord.add_argument("--config", required=True, help="run configuration (TOML)")
    coord.add_argument("--host", default="127.0.0.1", help="address for HTTP and the DHT (default 127.0.0.1)")
    coord.add_argument("--port", type=port_number, default=8000, help="HTTP port (default 8000)")
    coord.add_argument(
        "--dht-port", type=port_number, default=0, help="DHT port (default: any free port; fix it to restart in place)"
    )
    coord.add_argument(
        "--state-dir", type=Path, help="where the coordinator keeps what outlives it (default: swarm-state/RUN_ID)"
    )
    coord.add_argument(
        "--token",
        help="operator token for the control endpoints (default: $SWARM_TOKEN; without one, control is disabled)",
    )
    coord.set_defaults(func=cmd_coordinator)
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
