"""The `swarm` command line: one entry point, one subcommand per role."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import signal
import ssl
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from swarm.config import ConfigError, RunConfig, format_validation_error, load_config
from swarm.logs import LEVELS, setup_logging

if TYPE_CHECKING:
    from peer.options import PeerOptions


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


def host_name(text: str) -> str:
    """An IP address or a DNS name, as others would dial it."""
    name = text.strip()
    if not name or any(c in name for c in "/: ") and not _is_ipv6(name):
        raise argparse.ArgumentTypeError(f"{text!r} is not an IP address or host name")
    return name


def _is_ipv6(text: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(text).version == 6
    except ValueError:
        return False


def port_number(text: str) -> int:
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0..65535)")
    return value


def with_stages(run: RunConfig, count: int, option: str) -> RunConfig:
    """The run cut into `count` stages; a ConfigError naming `option` when the model cannot be."""
    try:
        return run.with_stages(count)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, option)) from None


def coordinator_url(flag: str | None, by_hand: bool) -> str | None:
    """--coordinator, else $SWARM_COORDINATOR (how a container is told), unless the command was given
    its run by hand (--config, --local, --peers): a flag always wins over the environment."""
    if flag is not None or by_hand:
        return flag
    return os.environ.get("SWARM_COORDINATOR")


def data_path(text: str) -> str:
    if not Path(text).exists():
        raise argparse.ArgumentTypeError(f"{text} does not exist")
    return text


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


def cmd_coordinator(args: argparse.Namespace) -> int:
    from coordinator.run import serve_coordinator

    if not args.config:
        raise ConfigError("swarm coordinator: --config is required to start one (or give an action: invite, revoke)")
    run = load_config(args.config)
    if args.stages is not None:
        run = with_stages(run, args.stages, "--stages")
    state_dir = args.state_dir or Path("swarm-state") / run.run_id
    token = args.token or os.environ.get("SWARM_TOKEN") or None
    return serve_coordinator(
        run,
        host=args.host,
        port=args.port,
        dht_port=args.dht_port,
        state_dir=state_dir,
        token=token,
        announce_host=args.announce_host,
        join_token=args.join_token,
        ready_file=args.ready_file,
        tls=tls_files(args.tls_cert, args.tls_key),
        invite_only=args.invite_only,
        cert_ttl=datetime.timedelta(hours=args.certificate_hours),
        lease_ttl_s=args.lease_ttl,
        relay_port=args.relay_port,
        relay_capacity=args.relay_capacity,
    )


DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def duration(text: str) -> float:
    """Seconds, from `90`, `90s`, `30m`, `12h` or `7d`; above 0."""
    number, unit = (text[:-1], text[-1]) if text[-1:].lower() in DURATION_UNITS else (text, "s")
    try:
        seconds = float(number) * DURATION_UNITS[unit.lower()]
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration above 0 (e.g. 3600, 30m, 12h, 7d)")
    return seconds


def invite_name(text: str) -> str:
    from coordinator.invites import InviteError, check_name

    try:
        return check_name(text)
    except InviteError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def operator_client(args: argparse.Namespace):  # -> coordinator.operator_client.OperatorClient
    from coordinator.operator_client import OperatorClient

    return OperatorClient(args.coordinator, args.token or os.environ.get("SWARM_TOKEN") or None)


def cmd_invite(args: argparse.Namespace) -> int:
    import datetime

    minted = operator_client(args).mint(args.name, args.max_peers, args.expires)
    limit = f"at most {minted['max_peers']} peer identities" if minted["max_peers"] else "no limit on peer identities"
    expires = minted["expires"]
    until = datetime.datetime.fromtimestamp(expires, datetime.UTC).strftime("%Y-%m-%d %H:%M UTC") if expires else None
    print(f"invite {minted['name']}: {limit}, {f'expires {until}' if until else 'never expires'}")
    print(f"token (shown only now): {minted['token']}")
    print(f"swarm peer --coordinator {args.coordinator} --join-token {minted['token']}")
    if not minted["guarded"]:
        print(
            "note: this run is open (started without --join-token or --invite-only): anyone may join without a token",
            file=sys.stderr,
        )
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    client = operator_client(args)
    if args.invite is not None:
        revoked = client.revoke_invite(args.invite)
        print(f"invite {revoked['name']} revoked, with the {revoked['identities']} peer identities it certified")
    else:
        client.remove_peer(args.peer)
        print(f"peer {args.peer} removed from the run and revoked")
    return 0


def add_operator_client(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--coordinator",
        type=http_url,
        metavar="URL",
        default="http://127.0.0.1:8000",
        help="the running coordinator (default http://127.0.0.1:8000)",
    )
    parser.add_argument(
        "--token",
        # SUPPRESS: `swarm coordinator --token T invite ...` keeps the T given before the action.
        default=argparse.SUPPRESS,
        help="the coordinator's operator token (default: $SWARM_TOKEN, which, unlike the flag, others cannot see)",
    )


def tls_files(cert: Path | None, key: Path | None) -> tuple[Path, Path] | None:
    """`--tls-cert` and `--tls-key`, checked now (both or neither; a certificate and its key that
    load), so that a mistake is named before anything starts."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise ConfigError("--tls-cert and --tls-key go together: give both, or neither for plain HTTP")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except OSError as err:  # ssl.SSLError is one
        raise ConfigError(f"--tls-cert {cert} / --tls-key {key}: cannot use them ({err})") from None
    return cert, key


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


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0 or value == float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text} must be a finite number >= 0")
    return value


def fraction(text: str) -> float:
    value = non_negative_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text} must be between 0 and 1")
    return value


def positive_float(text: str) -> float:
    value = non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"{text} must be above 0")
    return value


def memory_gb(text: str) -> int:
    """--max-memory: gigabytes (GiB), as bytes."""
    return int(positive_float(text) * 2**30)


def http_url(text: str) -> str:
    if not text.startswith(("http://", "https://")) or not text.split("://", 1)[1].strip("/"):
        raise argparse.ArgumentTypeError(f"{text!r} is not an http:// or https:// URL")
    return text


def cmd_export(args: argparse.Namespace) -> int:
    from swarm.export import export_swarm

    export_swarm(
        args.coordinator,
        args.out,
        timeout=args.timeout,
        note=lambda text: print(text, flush=True),
        force=args.force,
        join_token=args.join_token,
    )
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import time

    from swarm.generate import load_export, sample
    from swarm.tokenizer import load_tokenizer

    if not args.prompt:
        raise ConfigError("--prompt: must not be empty")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model, run = load_export(args.model)
    tokenizer = load_tokenizer(run.data.tokenizer)
    parameters = sum(p.numel() for p in model.parameters())
    print(
        f"loaded {args.model}: {parameters:,} parameters, vocabulary {tokenizer.vocab_size}, "
        f"context {run.model.seq_len} tokens",
        file=sys.stderr,
    )
    start = time.perf_counter()
    text, count = sample(
        model,
        tokenizer,
        args.prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k or None,
        seed=args.seed,
    )
    print(args.prompt + text, flush=True)
    print(f"{count} tokens in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


def cmd_tokenizer_train(args: argparse.Namespace) -> int:
    from swarm.tokenizer import train_from_files

    print(train_from_files(Path(args.data), args.vocab_size, args.out), flush=True)
    return 0


def add_join_token(parser: argparse.ArgumentParser, what: str) -> None:
    # The environment keeps the token out of `ps`; a flag is there for a quick try.
    parser.add_argument(
        "--join-token",
        metavar="TOKEN",
        default=os.environ.get("SWARM_JOIN_TOKEN") or None,
        help=f"{what} (default: $SWARM_JOIN_TOKEN, which, unlike the flag, other users of the machine cannot see)",
    )


def ready_file_path(text: str) -> Path:
    """A file to create, in a folder that exists (checked now: the file is written only once ready)."""
    path = Path(text).expanduser()
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: the folder {path.parent} does not exist")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: a folder, not a file")
    return path


def add_ready_file(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--ready-file",
        type=ready_file_path,
        metavar="PATH",
        help=f"write a JSON file here {what} (for scripts that start it; written whole, by a rename)",
    )


def add_join_wait(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--join-wait",
        metavar="SECONDS",
        type=non_negative_float,
        default=300.0,
        help="with --coordinator: keep trying a coordinator that does not answer (not started yet, restarting) "
        "this long before giving up (default 300)",
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

    peer = sub.add_parser(
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

    coord = sub.add_parser(
        "coordinator",
        help="bootstrap DHT node, REST API and dashboard of a run; mint and revoke its invites",
        usage="%(prog)s --config CONFIG [options]\n       %(prog)s {invite,revoke} [options]",
        description="Start the run's first DHT node and serve its REST API (--config C); or, with an action, "
        "mint or revoke invites through a running coordinator.",
    )
    coord.add_argument("--config", help="run configuration (TOML); required to start a coordinator")
    coord.add_argument("--host", default="127.0.0.1", help="address for HTTP and the DHT (default 127.0.0.1)")
    coord.add_argument(
        "--announce-host",
        type=host_name,
        help="the address peers on other machines reach the DHT at (a public IP or name), when not --host",
    )
    coord.add_argument("--port", type=port_number, default=8000, help="HTTP port (default 8000)")
    coord.add_argument(
        "--relay-port", type=port_number, default=0, help="the relay's gRPC port (default: any free port)"
    )
    coord.add_argument(
        "--relay-capacity",
        type=non_negative_int,
        default=32,
        help="peers nobody can dial that the coordinator relays at most (default 32; 0: no relay). Each gets a "
        "port of its own on --host",
    )
    coord.add_argument(
        "--dht-port", type=port_number, default=0, help="DHT port (default: any free port; fix it to restart in place)"
    )
    coord.add_argument(
        "--stages", type=positive_int, help="cut the model into this many stages (default: the config's stages.count)"
    )
    coord.add_argument(
        "--state-dir", type=Path, help="where the coordinator keeps what outlives it (default: swarm-state/RUN_ID)"
    )
    coord.add_argument(
        "--token",
        help="operator token for the control endpoints (default: $SWARM_TOKEN; without one, control is disabled)",
    )
    add_join_token(
        coord,
        "peers and trainers may give this token to join, as a shared invite (without it or --invite-only, anyone "
        "may join)",
    )
    coord.add_argument(
        "--invite-only",
        action="store_true",
        help="joining needs a token even without --join-token: an invite's (swarm coordinator invite)",
    )
    add_ready_file(coord, "once it serves: its run id, URL and DHT addresses")
    coord.add_argument("--tls-cert", type=Path, metavar="PEM", help="serve HTTPS with this certificate (chain)")
    coord.add_argument("--tls-key", type=Path, metavar="PEM", help="the private key of --tls-cert")
    coord.add_argument(
        "--certificate-hours",
        type=positive_float,
        default=24.0,
        metavar="H",
        help="how long the run certificates of peers and trainers are valid; they renew them halfway (default: 24)",
    )
    coord.add_argument(
        "--lease-ttl",
        type=positive_float,
        default=30.0,
        metavar="S",
        help="a trainer's lease of a data shard not renewed for this long expires, and the shard goes to the "
        "next trainer from where it stopped (default: 30)",
    )
    coord.set_defaults(func=cmd_coordinator)
    actions = coord.add_subparsers(
        dest="action",
        metavar="ACTION",
        title="actions on a running coordinator (instead of starting one)",
        prog="swarm coordinator",
    )
    invite = actions.add_parser(
        "invite",
        help="mint an invite: a join token for one volunteer, shown once",
        description="Mint an invite through the running coordinator and print its token (shown this once: the "
        "coordinator keeps only its hash) with the line to give the volunteer. Every peer identity certified "
        "with it counts against --max-peers.",
    )
    invite.add_argument("--name", required=True, type=invite_name, help="whom it is for: letters, digits, ._-")
    invite.add_argument(
        "--max-peers", type=positive_int, metavar="N", help="the most peer identities it certifies (default: no limit)"
    )
    invite.add_argument(
        "--expires",
        type=duration,
        metavar="D",
        help="admit no one after this long: seconds, or 30m, 12h, 7d (default: never)",
    )
    add_operator_client(invite)
    invite.set_defaults(func=cmd_invite)
    revoke = actions.add_parser(
        "revoke",
        help="revoke an invite (and every peer identity it certified) or one peer",
        description="Revoke through the running coordinator: members refuse the revoked peers' calls within "
        "seconds, and the coordinator certifies them no more.",
    )
    which = revoke.add_mutually_exclusive_group(required=True)
    which.add_argument("--invite", type=invite_name, metavar="NAME", help="the invite to revoke")
    which.add_argument("--peer", metavar="PEER_ID", help="the peer to remove from the run and revoke")
    add_operator_client(revoke)
    revoke.set_defaults(func=cmd_revoke)

    export = sub.add_parser(
        "export",
        help="gather the model from a live swarm into one Hugging Face checkpoint",
        description="Fetch every stage's weights from live peers (all at one optimizer step) and write a Hugging "
        "Face Llama checkpoint: model.safetensors, config.json, the run's tokenizer, swarm_export.json.",
    )
    export.add_argument("--coordinator", required=True, type=http_url, metavar="URL", help="the run's coordinator")
    export.add_argument("--out", required=True, type=Path, metavar="DIR", help="directory to write (created)")
    export.add_argument(
        "--force",
        action="store_true",
        help="write into a non-empty directory that is not a previous export (its other files are kept)",
    )
    export.add_argument(
        "--timeout",
        type=positive_float,
        default=60.0,
        metavar="S",
        help="seconds to wait for all stages to reach the same optimizer step (default 60)",
    )
    add_join_token(export, "the run's join token, if it has one")
    export.set_defaults(func=cmd_export)

    generate = sub.add_parser(
        "generate",
        help="sample text from an exported model",
        description="Load an export (swarm export --out DIR) on this machine's CPU and continue a prompt.",
    )
    generate.add_argument("--model", required=True, type=Path, metavar="DIR", help="the export's directory")
    generate.add_argument("--prompt", required=True, metavar="TEXT", help="text to continue")
    generate.add_argument(
        "--max-new-tokens", type=positive_int, default=200, metavar="N", help="tokens to generate (default 200)"
    )
    generate.add_argument(
        "--temperature",
        type=non_negative_float,
        default=0.8,
        metavar="T",
        help="sampling temperature; 0 takes the most likely token (default 0.8)",
    )
    generate.add_argument(
        "--top-k",
        type=non_negative_int,
        default=40,
        metavar="K",
        help="sample among the K likeliest tokens; 0: among all (default 40)",
    )
    generate.add_argument("--seed", type=non_negative_int, default=0, metavar="S", help="random seed (default 0)")
    generate.add_argument("--threads", type=positive_int, help="torch CPU threads (default: torch's choice)")
    generate.set_defaults(func=cmd_generate)

    tokenizer = sub.add_parser(
        "tokenizer",
        help="train a tokenizer for a run ([data] tokenizer = its file)",
        description="Make a tokenizer.json for a run's [data] tokenizer.",
    )
    tokenizer_actions = tokenizer.add_subparsers(dest="action", required=True, metavar="ACTION", prog="swarm tokenizer")
    train_tok = tokenizer_actions.add_parser(
        "train",
        help="fit a byte-level BPE to text files",
        description="Fit a byte-level BPE (the tokenizers package; any text encodes, <|endoftext|> is its special "
        "token) to a text file or a folder of text files, read one file at a time, and write it as tokenizer.json.",
    )
    train_tok.add_argument(
        "--data", required=True, type=data_path, metavar="PATH", help="a text file, or a folder of text files"
    )
    train_tok.add_argument(
        "--vocab-size", required=True, type=positive_int, metavar="N", help="tokens, 257 (bytes + 1) or more"
    )
    train_tok.add_argument(
        "--out", required=True, type=ready_file_path, metavar="FILE", help="the tokenizer.json to write"
    )
    train_tok.set_defaults(func=cmd_tokenizer_train)

    demo = sub.add_parser(
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
    for command in [*sub.choices.values(), invite, revoke, train_tok]:
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
