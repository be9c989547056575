"""`swarm coordinator`: its arguments and what it runs, including the actions on a running coordinator
(invite, revoke); the coordinator itself is imported only when it runs."""

from __future__ import annotations

import argparse
import datetime
import os
import ssl
import sys
from pathlib import Path

from pydantic import ValidationError

from swarm.arguments import (
    add_join_token,
    add_ready_file,
    duration,
    host_name,
    http_url,
    non_negative_int,
    port_number,
    positive_float,
    positive_int,
)
from swarm.config import ConfigError, RunConfig, format_validation_error, load_config


def add_commands(commands: argparse._SubParsersAction) -> list[argparse.ArgumentParser]:
    """Add `swarm coordinator` and its actions to `commands`; the parsers it made."""
    coord = commands.add_parser(
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
    return [coord, invite, revoke]


def with_stages(run: RunConfig, count: int, option: str) -> RunConfig:
    """The run cut into `count` stages; a ConfigError naming `option` when the model cannot be."""
    try:
        return run.with_stages(count)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, option)) from None


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
