"""Argument types and flags that several `swarm` subcommands share: each role's CLI module (peer/cli.py,
coordinator/cli.py, swarm/trainer/cli.py, ...) builds its parser from these, so a flag means and checks the
same everywhere. Light on purpose: `swarm --help` imports it."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


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
