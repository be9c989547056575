"""Starting real swarm processes for tests: each in its own process group, always cleaned up."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class Proc:
    def __init__(self, args: list[str], log: Path):
        self.log_path = log
        self._log = open(log, "w")  # noqa: SIM115 (closed in stop())
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
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
