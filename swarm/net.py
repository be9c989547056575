"""Ports on this machine, and whether an address leaves it."""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit


def is_loopback(host: str) -> bool:
    """Whether `host` (an IP address or a name, as in a URL) is this machine's loopback: traffic to it
    never leaves the machine. A name other than localhost is not resolved: it counts as remote."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cleartext_warning(url: str, secret: str) -> str | None:
    """A warning when `secret` would travel in clear to `url` (http:// to another machine), else None."""
    parts = urlsplit(url)
    if parts.scheme != "http" or is_loopback(parts.hostname or ""):
        return None
    return f"{secret} travels in clear to {url}: serve the coordinator over HTTPS (--tls-cert, --tls-key)"


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on at `host` now: the kernel hands one out and takes it back. Another
    process may take it before the caller binds it; where a server can bind port 0 itself and say
    which port it got (the ready file, swarm/ready.py), that is the better way."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def announce_address(host: str, port: int, announce_host: str | None = None) -> str:
    """HOST:PORT as others should dial it: `announce_host` when given, else the listening address
    (for 0.0.0.0, this machine's address as its own name resolves)."""
    if announce_host:
        host = announce_host
    elif host in ("0.0.0.0", "::", ""):
        host = socket.gethostbyname(socket.gethostname())
    return f"{host}:{port}"
