"""Swarm processes for the benchmarks, each in its own process group (swarm.children)."""

from __future__ import annotations

import re
import socket
import tempfile
import time
from pathlib import Path

import httpx

from swarm.children import JsonTail, Proc, stop_all, survivors

__all__ = ["JsonTail", "Proc", "stop_all", "survivors"]  # with the helpers below

ROOT = Path(__file__).resolve().parent.parent


def start_coordinator(config: Path, log: Path, timeout: float = 60) -> tuple[Proc, str]:
    """A coordinator on a free port, its state (history, DHT identity) next to its log."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    state = ["--state-dir", str(log.with_suffix(".state"))]
    proc = Proc(["coordinator", "--config", str(config), "--port", str(port), "--dht-port", "0", *state], log)
    deadline = time.monotonic() + timeout
    while not re.search(r"coordinator of run '\S+' at http://\S+", proc.output()):
        if proc.popen.poll() is not None or time.monotonic() > deadline:
            stop_all([proc])
            raise RuntimeError(f"the coordinator did not start:\n{proc.output()[-3000:]}")
        time.sleep(0.1)
    return proc, f"http://127.0.0.1:{port}"


def online_names(base: str) -> set[str]:
    state = httpx.get(f"{base}/api/v1/state", timeout=5).json()
    return {p["public_name"] for s in state["stages"] for p in s["peers"] if p["state"] == "online"}


def listed_names(base: str) -> set[str]:
    state = httpx.get(f"{base}/api/v1/state", timeout=5).json()
    return {p["public_name"] for s in state["stages"] for p in s["peers"]}


def start_peer(url: str, name: str, stage: int | str, tmp: Path, *extra: str) -> Proc:
    """`swarm peer` of the run at `url` on `stage` (a number or 'auto'), one torch thread."""
    args = ["peer", "--coordinator", url, "--stage", str(stage), "--public-name", name, "--threads", "1"]
    args += ["--checkpoint-dir", "none"]  # every benchmark run starts from the seeded init
    return Proc([*args, *extra], tmp / f"{name}.log")


def wait_online(url: str, peers: dict[str, Proc], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not set(peers) <= online_names(url):
        dead = [n for n, p in peers.items() if p.popen.poll() is not None]
        if dead or time.monotonic() > deadline:
            tails = "\n".join(f"--- {n}\n{peers[n].output()[-1500:]}" for n in dead or peers)
            why = "exited: " + ", ".join(dead) if dead else "timeout"
            raise RuntimeError(f"peers not online ({why}):\n{tails}")
        time.sleep(0.5)
    print(f"peers online: {', '.join(peers)}", flush=True)


def log_dir(path: str | None, name: str) -> Path:
    """--log-dir, or a new /tmp/swarm-NAME-* folder; says where the logs go."""
    tmp = Path(path) if path else Path(tempfile.mkdtemp(prefix=f"swarm-{name}-"))
    tmp.mkdir(parents=True, exist_ok=True)
    print(f"{name}: logs in {tmp}", flush=True)
    return tmp
