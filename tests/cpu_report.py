"""Which tests cost the machine's CPU: with SWARM_TEST_CPU=FILE, every test appends a line to FILE
(tab-separated: its node id, wall seconds, CPU seconds), the CPU of every process it ran in its time.

The suite is bound by its cores (docs/testing.md): a test that waits costs the other worker nothing,
one whose swarm computes or chats over its DHT does, so the wall times pytest prints (`--durations`)
tell where the suite waits, and these lines where its CPU goes. A test's CPU is that of its worker and
of every process under it (the zygote, the swarms forked from it, their DHT processes and p2p
daemons), read from Linux's /proc before and after the test: what ran and was reaped in between is in
its parent's count of reaped children. The first test of a module that shares a swarm carries the
swarm's start, and a worker's first test that forks a command the zygote's imports; a process orphaned to init (a p2p daemon whose parent was killed first) takes the CPU
it spent after that with it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

ENV = "SWARM_TEST_CPU"
TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int | str) -> tuple[int, float] | None:
    """(parent pid, CPU seconds of the process and of its reaped children), None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), sum(int(f) for f in fields[11:15]) / TICK  # utime stime cutime cstime


def tree_cpu(root: int) -> float:
    """CPU seconds of `root` and of its live descendants, each with its reaped children."""
    stats = {int(pid): s for pid in os.listdir("/proc") if pid.isdigit() and (s := _stat(pid)) is not None}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += stats[pid][1]
            todo += children.get(pid, [])
    return total


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    path = os.environ.get(ENV)
    if not path:
        return (yield)
    cpu, wall = tree_cpu(os.getpid()), time.monotonic()
    try:
        return (yield)
    finally:
        line = f"{item.nodeid}\t{time.monotonic() - wall:.2f}\t{tree_cpu(os.getpid()) - cpu:.2f}\n"
        with open(path, "a") as out:  # one short write per line: the workers' lines do not mix
            out.write(line)
