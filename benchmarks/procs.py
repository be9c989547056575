"""Swarm processes for the benchmarks, each in its own process group (as in tests/processes.py,
which is not installed with the package)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


class Proc:
    """`python -m swarm.cli ARGS` in its own process group, output to `log`."""

    def __init__(self, args: list[str], log: Path):
        self.log_path = log
        self._log = open(log, "w")  # noqa: SIM115 (closed in stop())
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "swarm.cli", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )

    def output(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> None:
        """Close the log of a process that has exited (see stop_all)."""
        self.popen.poll()
        self._log.close()


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


def survivors(pgid: int, timeout: float = 5.0) -> list[str]:
    """Processes of the group still running (zombies are dead, only not yet reaped), as 'PID STATE',
    after waiting up to `timeout` for them to go."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                alive.append(f"{entry} {fields[0]}")
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def online_names(base: str) -> set[str]:
    state = httpx.get(f"{base}/api/v1/state", timeout=5).json()
    return {p["public_name"] for s in state["stages"] for p in s["peers"] if p["state"] == "online"}


def listed_names(base: str) -> set[str]:
    state = httpx.get(f"{base}/api/v1/state", timeout=5).json()
    return {p["public_name"] for s in state["stages"] for p in s["peers"]}


def stop_all(procs: list[Proc], timeout: float = 15.0) -> None:
    """SIGTERM every group at once, SIGKILL what is still there after `timeout`, close the logs."""
    live = [p for p in procs if p.popen.poll() is None]
    for p in live:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.popen.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in live:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.popen.wait(max(0.1, deadline - time.monotonic()))
    for p in procs:
        # Children of the group (p2pd) may outlive their parent: nothing of a group is left behind.
        if survivors(p.popen.pid, timeout=2 if p in live else 0):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.popen.pid, signal.SIGKILL)
        p.stop()


class JsonTail:
    """New complete lines of a file that another process appends to, with the time each was first seen."""

    def __init__(self, path: Path):
        self.path, self.pos, self.buf = path, 0, ""
        self.records: list[dict] = []
        self.seen: list[float] = []  # time.monotonic() when each record was first read

    def poll(self) -> int:
        try:
            with open(self.path) as f:
                f.seek(self.pos)
                data = f.read()
                self.pos = f.tell()
        except FileNotFoundError:
            return 0
        now = time.monotonic()
        *lines, self.buf = (self.buf + data).split("\n")
        for line in lines:
            if line.strip():
                self.records.append(json.loads(line))
                self.seen.append(now)
        return len(lines)

    def start(self) -> float | None:
        """The trainer's elapsed_s = 0 on this process's monotonic clock (an upper bound, tight to a poll)."""
        if not self.records:
            return None
        return min(t - r["elapsed_s"] for t, r in zip(self.seen, self.records, strict=True))


def start_peer(url: str, name: str, stage: int | str, tmp: Path, *extra: str) -> Proc:
    """`swarm peer` of the run at `url` on `stage` (a number or 'auto'), one torch thread."""
    args = ["peer", "--coordinator", url, "--stage", str(stage), "--public-name", name, "--threads", "1"]
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
