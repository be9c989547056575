"""Child processes of a swarm on one machine (`swarm demo`, the benchmarks, the tests): each `swarm`
command in its own process group, so that ending the group also ends what it started (a DHT node's
child process and its p2pd), with its output in a log file. A child started with a ready file says
when it serves through that file (swarm/ready.py), never through its printed output.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from swarm.ready import CoordinatorReady, wait_ready

START_TIMEOUT_S = 60.0
ZYGOTE_ENV = "SWARM_ZYGOTE"  # "1": fork the commands from a zygote (`Proc.forked`)


@functools.cache
def http(verify: bool | str = True) -> httpx.Client:
    """An HTTP client kept for the whole process (one per `verify`, as httpx takes it), for whoever
    watches the children's coordinator. `httpx.get` builds a client, and with it an SSL context, at
    every call: about 50 ms of CPU, which a loop asking every 0.2 s turns into a quarter of a core
    taken from the swarm it watches."""
    return httpx.Client(timeout=5, verify=verify)


class Proc:
    """`python -m swarm.cli ARGS` in its own process group, output to `log` (forked from a zygote with
    SWARM_ZYGOTE=1, see `forked`). With `ready`, the command gets `--ready-file` (next to the log,
    `proc.ready_file`) for `swarm.ready.wait_ready`. `env`: variables added to this process's
    environment; `prefix`: what runs the command (e.g. `ip netns exec NS`, which keeps the process and
    its group)."""

    def __init__(
        self,
        args: list[str],
        log: Path,
        ready: bool = False,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
        prefix: list[str] | None = None,
    ):
        self.args = args
        self.log_path = log
        self.ready_file = log.with_suffix(".ready") if ready else None
        if self.ready_file is not None:
            self.ready_file.unlink(missing_ok=True)  # an earlier run's, in a reused folder
            args = [*args, "--ready-file", str(self.ready_file)]
        self._log = open(log, "w")  # noqa: SIM115 (closed in close())
        self.popen = self.spawn(args, cwd, {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, prefix or [])

    def forked(self) -> bool:
        """Whether the command is forked from this process's zygote (swarm/zygote.py) rather than a new
        interpreter: with SWARM_ZYGOTE=1 in the environment, for whoever starts many commands."""
        return os.environ.get(ZYGOTE_ENV) == "1"

    def spawn(self, args: list[str], cwd: Path | None, env: dict[str, str], prefix: list[str]):
        """Start `python -m swarm.cli ARGS` (under `prefix`) in a session of its own, output to the log:
        a `subprocess.Popen`, or the zygote's `Forked` (which has the part of it used here)."""
        netns = prefix[3] if len(prefix) == 4 and prefix[:3] == ["ip", "netns", "exec"] else None
        if self.forked() and (not prefix or netns):
            from swarm.zygote import zygote  # imports torch and hivemind: only where it is used

            return zygote().spawn(args, self.log_path, cwd or Path.cwd(), env, netns=netns)
        return subprocess.Popen(
            [*prefix, sys.executable, "-m", "swarm.cli", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            env=env,
            start_new_session=True,
        )

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal_group(self, sig: int) -> None:
        """Send `sig` to the whole process group (nothing when it is gone)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig)

    def reap(self, timeout: float) -> None:
        """Wait up to `timeout` for the process to exit; SIGKILL its group when it does not."""
        try:
            self.popen.wait(max(0.0, timeout))
        except subprocess.TimeoutExpired:
            self.signal_group(signal.SIGKILL)
            self.popen.wait()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        """Signal the whole process group, SIGKILL it when the process has not exited within
        `timeout`, close the log; the exit code. Whatever else of the group outlives the process
        is left for the caller to see (`survivors`)."""
        if self.alive():
            self.signal_group(sig)
            self.reap(timeout)
        self.close()
        return self.popen.returncode

    def close(self) -> None:
        """Close the log of a process that has exited."""
        self.popen.poll()
        self._log.close()


def processes() -> list[tuple[int, str, int, int]]:
    """Every process (live or zombie) as (pid, state, ppid, process group), read from Linux's /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp
        except OSError:
            continue
        found.append((int(entry), fields[0], int(fields[1]), int(fields[2])))
    return found


def group_members(pgid: int) -> list[str]:
    """Processes (live or zombie) whose process group is `pgid`, as 'PID STATE'."""
    return [f"{pid} {state}" for pid, state, _, group in processes() if group == pgid]


def survivors(pgid: int, timeout: float = 5.0) -> list[str]:
    """Processes of the group still running (zombies are dead, only not yet reaped), as 'PID STATE',
    after waiting up to `timeout` for them to go."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [m for m in group_members(pgid) if not m.endswith(" Z")]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def stop_all(procs: list[Proc], timeout: float = 15.0) -> None:
    """SIGTERM every group at once, SIGKILL what is still there after `timeout`, close the logs."""
    live = [p for p in procs if p.alive()]
    for p in live:
        p.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in live:
        p.reap(deadline - time.monotonic())
    for p in procs:
        # Children of the group (p2pd) may outlive their parent: nothing of a group is left behind.
        if survivors(p.popen.pid, timeout=2 if p in live else 0):
            p.signal_group(signal.SIGKILL)
        p.close()


def coordinator(config: Path, log: Path, *extra: str, port: int = 0, kind: type[Proc] = Proc, **proc_options) -> Proc:
    """`swarm coordinator` of `config` on `port` (0: any free port, which its ready file names) and
    any free DHT port, its state (history, DHT identity) next to its log, with a ready file. Options
    in `extra` win over these (argparse keeps the last); `proc_options` go to `kind` (Proc or a
    subclass that starts it otherwise)."""
    state = ["--state-dir", str(log.with_suffix(".state"))]
    args = ["coordinator", "--config", str(config), "--port", str(port), "--dht-port", "0", *state, *extra]
    return kind(args, log, ready=True, **proc_options)


def start_coordinator(
    config: Path, log: Path, *extra: str, port: int = 0, timeout: float = START_TIMEOUT_S, **proc_options
) -> tuple[Proc, str]:
    """A `coordinator` once it serves, and its base URL; stopped again when it does not start."""
    proc = coordinator(config, log, *extra, port=port, **proc_options)
    try:
        ready = wait_ready(proc, CoordinatorReady, timeout)
    except BaseException:
        stop_all([proc])
        raise
    return proc, ready.url


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
