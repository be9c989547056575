"""`swarm peer`: its arguments and what it runs (the daemon and the stage worker are imported only when it runs)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from swarm.arguments import (
    add_join_token,
    add_join_wait,
    add_ready_file,
    coordinator_url,
    host_name,
    memory_gb,
    non_negative_float,
    non_negative_int,
    port_number,
    positive_int,
)
from swarm.config import ConfigError, load_config

if TYPE_CHECKING:
    from peer.options import PeerOptions


def add_commands(commands: argparse._SubParsersAction) -> list[argparse.ArgumentParser]:
    """Add `swarm peer` to `commands`; the parsers it made."""
    peer = commands.add_parser(
        "peer",
        help="join a run as a peer (or serve one stage by hand)",
        description="Join a run through its coordinator and serve a stage until SIGTERM or Ctrl-C; "
        "or, with --config and --stage, serve one stage by hand.",
    )
    peer.add_argument(
        "--coordinator",
        metavar="URL",
        help="the run's coordinator, e.g. http://host:8000 (default: $SWARM_COORDINATOR)",
    )
    peer.add_argument("--config", help="run configuration (TOML), to serve a stage by hand")
    peer.add_argument(
        "--stage",
        type=stage_choice,
        default=None,
        help="stage index, or 'auto' (default with --coordinator): the least served stage",
    )
    peer.add_argument(
        "--public-name",
        default=os.environ.get("SWARM_PUBLIC_NAME", ""),
        help="name shown on the dashboard (default: $SWARM_PUBLIC_NAME)",
    )
    peer.add_argument("--no-rebalance", action="store_true", help="stay on the first stage (never move)")
    peer.add_argument(
        "--relay",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="carry the traffic of up to N peers nobody can dial (behind home routers), when this one is reachable; "
        "each gets a port of its own on --host (default 0: none)",
    )
    # Faults for tests (peer/options.py: Faults), hidden from --help.
    peer.add_argument("--delay-per-sample", type=non_negative_float, default=0.0, help=argparse.SUPPRESS)
    peer.add_argument("--log-steps", type=Path, default=None, help=argparse.SUPPRESS)
    peer.add_argument("--corrupt-outputs", type=non_negative_float, default=0.0, help=argparse.SUPPRESS)
    peer.add_argument("--corrupt-grads", type=non_negative_float, default=0.0, help=argparse.SUPPRESS)
    peer.add_argument("--lie-after", type=non_negative_int, default=None, help=argparse.SUPPRESS)
    peer.add_argument("--malformed", choices=("shape", "nan"), default=None, help=argparse.SUPPRESS)
    peer.add_argument("--restless", action="store_true", help=argparse.SUPPRESS)
    peer.add_argument("--state-delay", type=non_negative_float, default=0.0, help=argparse.SUPPRESS)
    peer.add_argument("--non-finite-grads", action="store_true", help=argparse.SUPPRESS)
    peer.add_argument("--claim-steps", type=non_negative_int, default=None, help=argparse.SUPPRESS)
    peer.add_argument("--declare-samples", type=non_negative_int, default=None, help=argparse.SUPPRESS)
    peer.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    peer.add_argument("--port", type=port_number, default=0, help="port to listen on (default: any free port)")
    peer.add_argument("--dht-port", type=port_number, default=0, help="the DHT node's port (default: any free port)")
    peer.add_argument(
        "--announce-host",
        type=host_name,
        default=os.environ.get("SWARM_ANNOUNCE_HOST") or None,
        help="the address others reach this machine at, when not the one it listens on: a public IP or name, "
        "behind NAT the router's with --port and --dht-port forwarded (default: $SWARM_ANNOUNCE_HOST)",
    )
    peer.add_argument(
        "--device",
        default=os.environ.get("SWARM_DEVICE") or None,
        help="auto, cpu, cuda or cuda:N (default: $SWARM_DEVICE, else auto)",
    )
    peer.add_argument("--threads", type=positive_int, help="torch CPU threads (default: torch's choice)")
    peer.add_argument(
        "--inflight",
        metavar="N",
        type=non_negative_int,
        help="forward graphs kept for their backward, each a microbatch of activations in memory; the rest are "
        "recomputed in backward (default: the run's serve.cache_size)",
    )
    peer.add_argument(
        "--max-memory",
        metavar="GB",
        type=memory_gb,
        help="memory a stage may take on the device, below what the device has (default: all it has); "
        "a stage that needs more is refused",
    )
    peer.add_argument(
        "--dry-run",
        action="store_true",
        help="print every stage's memory estimate on this device, marking those that fit, and exit "
        "(0 when one fits) without serving",
    )
    peer.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        type=checkpoint_dir_choice,
        default=os.environ.get("SWARM_CHECKPOINT_DIR") or "~/.cache/swarm/checkpoints",
        help="with --coordinator: save the stage's weights and optimizer state here, and resume from them when "
        "newer than the live peers' (default: $SWARM_CHECKPOINT_DIR, else ~/.cache/swarm/checkpoints; "
        "'none': no checkpoints)",
    )
    peer.add_argument(
        "--checkpoint-every",
        metavar="N",
        type=positive_int,
        default=50,
        help="with --coordinator: save a checkpoint every N optimizer steps (default 50)",
    )
    add_join_token(peer, "the run's join token, if it has one (with --config: what callers must send)")
    add_join_wait(peer)
    add_ready_file(peer, "once it serves its stage (again after a move): run id, stage, address, peer id")
    peer.set_defaults(func=cmd_peer)
    return [peer]


def stage_choice(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        return non_negative_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither 'auto' nor a stage index") from None


def checkpoint_dir_choice(text: str) -> Path | None:
    """A folder for a peer's checkpoints, or None for 'none' (no checkpoints)."""
    return None if text.strip().lower() == "none" else Path(text).expanduser()


def peer_options(args: argparse.Namespace) -> PeerOptions:
    """The options of `swarm peer --coordinator URL`, from its parsed flags."""
    from peer.options import Faults, PeerOptions

    return PeerOptions(
        coordinator=args.coordinator,
        stage=args.stage,
        host=args.host,
        port=args.port,
        dht_port=args.dht_port,
        announce_host=args.announce_host,
        device=args.device,
        public_name=args.public_name,
        threads=args.threads,
        rebalance=not args.no_rebalance,
        relay=args.relay,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        join_token=args.join_token,
        join_wait=args.join_wait,
        ready_file=args.ready_file,
        inflight=args.inflight,
        max_memory=args.max_memory,
        faults=Faults(
            delay_per_sample=args.delay_per_sample,
            corrupt_outputs=args.corrupt_outputs,
            corrupt_grads=args.corrupt_grads,
            lie_after=args.lie_after,
            malformed=args.malformed,
            non_finite_grads=args.non_finite_grads,
            log_steps=args.log_steps,
            restless=args.restless,
            state_delay_s=args.state_delay,
            claim_steps=args.claim_steps,
            declare_samples=args.declare_samples,
        ),
    )


def peer_dry_run(args: argparse.Namespace) -> int:
    """`swarm peer --dry-run`: every stage's memory estimate on this device, marking those that fit;
    0 when one does."""
    from swarm import memory
    from swarm.device import resolve_device
    from swarm.join import fetch_join

    if args.coordinator:
        run, _ = fetch_join(args.coordinator, join_token=args.join_token, wait_s=args.join_wait)
    else:
        run = load_config(args.config)
    device = resolve_device(args.device)
    inflight = memory.peer_inflight(run, args.inflight)
    text, fits = memory.dry_run(run, device, inflight, memory.budget(device, args.max_memory))
    print(text)
    return 0 if fits else 1


def cmd_peer(args: argparse.Namespace) -> int:
    args.coordinator = coordinator_url(args.coordinator, bool(args.config))
    if args.dry_run:
        if bool(args.coordinator) == bool(args.config):
            raise ConfigError("swarm peer --dry-run: give --coordinator URL or --config C (one of them)")
        return peer_dry_run(args)
    if args.coordinator:
        if args.config:
            raise ConfigError("swarm peer: give --coordinator (join a run) or --config (serve by hand), not both")
        from peer.daemon import exit_now, run_peer

        code = run_peer(peer_options(args))
        exit_now(code)
    if not args.config or args.stage is None:
        raise ConfigError("swarm peer: give --coordinator URL (or $SWARM_COORDINATOR), or --config C with --stage K")
    from peer.run import serve_stage

    run = load_config(args.config)
    return serve_stage(
        run,
        args.stage,
        args.host,
        args.port,
        device=args.device,
        threads=args.threads,
        join_token=args.join_token,
        ready_file=args.ready_file,
        inflight=args.inflight,
        max_memory=args.max_memory,
        faults=peer_options(args).faults,
    )
