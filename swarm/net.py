"""Ports on this machine."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on at `host` now: the kernel hands one out and takes it back. Another
    process may take it before the caller binds it; where a server can bind port 0 itself and say
    which port it got (the ready file, swarm/ready.py), that is the better way."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
