"""Starting real swarm processes for tests: each in its own process group, always cleaned up."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


class Proc:
    def __init__(self, args: list[str], log: Path):
        self.log_path = log
        self._log = open(log, "w")  # noqa: SIM115 (closed in stop())
        # Peers keep their checkpoints next to the test's logs: never in the user's cache, where a
        # later test of the same run id would resume from them.
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "SWARM_CHECKPOINT_DIR": str(log.parent / "checkpoints")}
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "swarm.cli", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=env,
            start_new_session=True,
        )

    def output(self) -> str:
        return self.log_path.read_text()

    def wait_for_line(self, pattern: str, timeout: float = 60) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.output())
            if m:
                return m
            if self.popen.poll() is not None:
                raise RuntimeError(f"process exited with {self.popen.returncode}:\n{self.output()[-3000:]}")
            time.sleep(0.1)
        raise TimeoutError(f"no line matching {pattern!r} within {timeout} s:\n{self.output()[-3000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
        """Signal the whole process group; SIGKILL it if it does not exit in time."""
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
            except ProcessLookupError:
                pass
        self._log.close()
        return self.popen.returncode


def start_peer(config: Path | str, stage: int, tmp: Path, *extra: str) -> tuple[Proc, str]:
    """A stage worker on a free loopback port; returns it and its address once it serves."""
    proc = Proc(
        ["peer", "--config", str(config), "--stage", str(stage), "--port", "0", "--threads", "1", *extra],
        tmp / f"peer-{stage}-{time.monotonic_ns()}.log",
    )
    m = proc.wait_for_line(r"serving on (\S+:\d+)")
    return proc, m.group(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_coordinator(config: Path, log: Path, *extra: str, port: int | None = None) -> tuple[Proc, str]:
    """A coordinator on `port` (default: a free one) with its state next to its log; returns it and
    its base URL once it serves. Options in `extra` win over these (argparse keeps the last)."""
    port = port or free_port()
    state = ["--state-dir", str(log.with_suffix(".state"))]
    proc = Proc(["coordinator", "--config", str(config), "--port", str(port), "--dht-port", "0", *state, *extra], log)
    try:
        proc.wait_for_line(r"coordinator of run '\S+' at http://\S+", timeout=60)
    except BaseException:
        proc.stop()
        raise
    return proc, f"http://127.0.0.1:{port}"


def group_members(pgid: int) -> list[str]:
    """Processes (live or zombie) whose process group is `pgid`, as 'PID STATE'."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid:
            found.append(f"{entry} {fields[0]}")
    return found


def wait_for_state(base: str, ok: Callable[[dict], bool], timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = httpx.get(f"{base}/api/v1/state", timeout=5).json()
        if ok(state):
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"/api/v1/state did not reach the expected state within {timeout} s: {state}")
        time.sleep(0.2)


def survivors(pgid: int, timeout: float = 5.0) -> list[str]:
    """Processes of the group still running (zombies are dead, only not yet reaped), after waiting
    up to `timeout` for them to go."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [m for m in group_members(pgid) if not m.endswith(" Z")]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)
