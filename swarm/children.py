"""Child processes of a swarm on one machine (`swarm demo`, the benchmarks): each `swarm` command in
its own process group, so that ending the group also ends what it started (a DHT node's child
process and its p2pd), with its output in a log file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path


class Proc:
    """`python -m swarm.cli ARGS` in its own process group, output to `log`."""

    def __init__(self, args: list[str], log: Path, cwd: Path | None = None):
        self.args = args
        self.log_path = log
        self._log = open(log, "w")  # noqa: SIM115 (closed in stop())
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "swarm.cli", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        """The first match of `pattern` in the output; RuntimeError when the process exits or
        `timeout` passes first (with the end of its output)."""
        deadline = time.monotonic() + timeout
        while True:
            m = re.search(pattern, self.output())
            if m:
                return m
            if self.popen.poll() is not None:
                raise RuntimeError(f"exited with {self.popen.returncode}:\n{self.output()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no line matching {pattern!r} within {timeout:.0f} s:\n{self.output()[-3000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        """Close the log of a process that has exited (see stop_all)."""
        self.popen.poll()
        self._log.close()


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
