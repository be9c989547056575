"""Which tests cost the machine's CPU: with SWARM_TEST_CPU=FILE, every test appends a line to FILE
(tab-separated: its node id, wall seconds, CPU seconds, the xdist worker, the Unix time it began), the
CPU of every process it ran in its time; the last two columns show when a worker waited alone.

The suite is bound by its cores (docs/testing.md): a test that waits costs the other worker nothing,
one whose swarm computes or chats over its DHT does, so the wall times pytest prints (`--durations`)
tell where the suite waits, and these lines where its CPU goes. A test's CPU is that of its worker and
of every process under it (the zygote, the commands forked from it, their DHT processes and p2p
daemons), read from Linux's /proc every PERIOD_S while the test runs and at its start and end. Read
only at the start and the end, most of a swarm's CPU was missing: a swarm is ended with SIGKILL to
every process at once, and a DHT process or p2p daemon whose parent died first is reaped by init,
which keeps its CPU. What a process spends in its last PERIOD_S before it is killed is still lost.
The first test of a module that shares a swarm carries the swarm's start, and a worker's first test
that forks a command the zygote's imports.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

ENV = "SWARM_TEST_CPU"
PERIOD_S = 0.5
TICK = os.sysconf("SC_CLK_TCK")


def _processes() -> dict[int, tuple[int, int, float]]:
    """Every process: pid -> (parent pid, start time in clock ticks since boot, its own CPU seconds)."""
    found = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        found[int(pid)] = (int(fields[1]), int(fields[19]), (int(fields[11]) + int(fields[12])) / TICK)
    return found


def _tree(processes: dict[int, tuple[int, int, float]], root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in processes.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in processes:
            found.append(pid)
            todo += children.get(pid, [])
    return found


def _now_ticks() -> float:
    return float(Path("/proc/uptime").read_text().split()[0]) * TICK


class TreeCPU:
    """The CPU seconds that `root` and the processes under it spend between `start` and `stop`, from
    samples of /proc every `period` s (a process is told apart from a later one with its pid by its
    start time)."""

    def __init__(self, root: int, period: float = PERIOD_S):
        self.root = root
        self.lock = threading.Lock()
        self.first: dict[tuple[int, int], float] = {}
        self.last: dict[tuple[int, int], float] = {}
        self.since = _now_ticks()
        self.running = False
        threading.Thread(target=self._sample_every, args=(period,), name="test-cpu", daemon=True).start()

    def _sample_every(self, period: float) -> None:
        while True:
            time.sleep(period)
            if self.running:
                self.sample()

    def sample(self) -> None:
        processes = _processes()
        with self.lock:
            for pid in _tree(processes, self.root):
                _, started, cpu = processes[pid]
                key = (pid, started)
                # A process started since `start` counts from nothing, one already running from now.
                self.first.setdefault(key, 0.0 if started >= self.since else cpu)
                self.last[key] = cpu

    def start(self) -> None:
        with self.lock:
            self.first, self.last, self.since = {}, {}, _now_ticks()
        self.sample()
        self.running = True

    def stop(self) -> float:
        self.running = False
        self.sample()
        with self.lock:
            return sum(cpu - self.first[key] for key, cpu in self.last.items())


_meter: TreeCPU | None = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    global _meter
    path = os.environ.get(ENV)
    if not path:
        return (yield)
    if _meter is None:
        _meter = TreeCPU(os.getpid())
    _meter.start()
    wall, began = time.monotonic(), time.time()
    try:
        return (yield)
    finally:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "-")
        line = f"{item.nodeid}\t{time.monotonic() - wall:.2f}\t{_meter.stop():.2f}\t{worker}\t{began:.1f}\n"
        with open(path, "a") as out:  # one short write per line: the workers' lines do not mix
            out.write(line)
