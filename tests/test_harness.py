"""The test harness itself (tests/harness.py): what it ends after a test, and what it must leave."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

import torch
from hivemind.utils.mpfuture import MPFuture

from swarm.children import http
from swarm.children import processes as process_table
from swarm.zygote import process_locks, renew, zygote
from tests.cpu_report import TreeCPU
from tests.harness import TINY, command_name, end_groups, own_children
from tests.processes import child, start_coordinator


def test_ending_a_tests_leftovers_spares_torchs_shared_memory_manager(processes):
    """The first shared tensor of a process starts torch's manager, a session of its own: ended with a
    test's leftovers, the next shared tensor freed (hivemind's step controls hold some) aborts the run."""
    before = own_children()
    shared = torch.zeros(4).share_memory_()
    # This process's own manager (its child): the managers of other tests' processes (another xdist
    # worker's swarm) end with those processes, whenever that worker's tests end them.
    managers = [
        pid for pid, _, ppid, _ in process_table() if ppid == os.getpid() and command_name(pid) == "torch_shm_manag"
    ]
    assert managers, "no torch_shm_manager running after share_memory_()"
    end_groups(own_children() - before)
    assert all(command_name(pid) for pid in managers), "torch's shared-memory manager was ended"
    del shared
    torch.zeros(4).share_memory_()  # with its manager gone, this (or the free above) aborts the process


def test_a_command_forked_from_the_zygote_runs_as_a_new_interpreter_would(processes, tmp_path):
    """swarm/zygote.py: a `swarm` command forked from the zygote (which imported torch and hivemind
    once) writes to its log, exits with the command's status, and leads a session of its own."""
    bad = child(["peer", "--stage", "nope"], tmp_path / "bad.log")
    assert bad.popen.wait(60) == 2, bad.output()
    assert "argument --stage: 'nope' is neither" in bad.output(), bad.output()
    assert process_row(bad.popen.pid) is None  # reaped by the zygote: no zombie left

    proc, url = start_coordinator(TINY, tmp_path / "coordinator.log")
    pid, z = proc.popen.pid, zygote().pid()
    _, state, ppid, group = process_row(pid)
    assert (ppid, group) == (z, pid), (ppid, group, z)  # the zygote's child, its own session's leader
    assert http().get(f"{url}/api/v1/state").status_code == 200
    # A test's leftover: ended with the others, and the zygote never is.
    assert pid in own_children() and z not in own_children()
    end_groups({pid})
    assert proc.popen.wait(15) is not None and process_row(pid) is None
    assert process_row(z) is not None


# A process that starts commands with the zygote lent to it: a `swarm` command that exits at once, its
# exit status, the lent zygote's pid and whether the borrower started an interpreter of its own.
BORROWER = """
import json, os, sys
from pathlib import Path
from swarm.zygote import PIPES_ENV, zygote
z = zygote()
command = z.spawn(["peer", "--stage", "nope"], Path(sys.argv[1]), Path.cwd(), dict(os.environ))
said = {"code": command.wait(60), "zygote": z.pid(), "own": z.proc is not None, "env": PIPES_ENV in os.environ}
print(json.dumps(said))
"""


def test_a_zygote_lent_to_a_process_forks_its_commands_and_ends_with_it(processes, tmp_path):
    """swarm/zygote.py `Zygote.lend`: a zygote forked from this process's, already imported, serves the
    process given its FIFOs (a benchmark the tests run), which starts no zygote of its own (6 s of CPU),
    and the lent zygote exits once that process has."""
    pipes, lent = zygote().lend(tmp_path)
    assert process_row(lent.pid)[2] == zygote().pid()  # a child of this process's zygote
    env = {**os.environ, **pipes}
    done = subprocess.run(
        [sys.executable, "-c", BORROWER, str(tmp_path / "bad.log")], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.splitlines()[-1])
    assert said == {"code": 2, "zygote": lent.pid, "own": False, "env": False}, said
    assert "argument --stage: 'nope' is neither" in (tmp_path / "bad.log").read_text()
    assert lent.wait(10) == 0  # its borrower closed the pipe: it exited by itself


def test_a_command_signalled_the_moment_it_starts_ends(processes, tmp_path):
    """The zygote says a command started once it leads its process group, so that a signal to the group
    sent at once reaches it. Sent before, it found no group and was dropped (ProcessLookupError): a peer
    started as a benchmark stopped its swarm went on to serve until it was SIGKILLed 15 s later."""
    # Peers of a coordinator nobody serves: they keep trying it for --join-wait's 300 s.
    procs = [child(["peer", "--coordinator", "http://127.0.0.1:1"], tmp_path / f"p{i}.log") for i in range(3)]
    try:
        for proc in procs:
            proc.signal_group(signal.SIGTERM)
        codes = [proc.popen.wait(15) for proc in procs]
    finally:
        for proc in procs:
            proc.signal_group(signal.SIGKILL)
            proc.close()
    assert codes == [-signal.SIGTERM] * len(procs), [proc.output() for proc in procs]


def process_row(pid: int) -> tuple[int, str, int, int] | None:
    """(pid, state, ppid, group) of a live process, None when it is gone (or a zombie)."""
    return next((row for row in process_table() if row[0] == pid and row[1] != "Z"), None)


def test_a_fork_of_the_zygote_gets_hiveminds_process_wide_locks_of_its_own(processes):
    """hivemind makes multiprocessing locks at import (MPFuture's update lock and others). The zygote
    finds them and each command forked from it makes its own: shared, a peer killed while it held one
    left every later command's DHT node waiting for it (their coordinators never started). Here the
    test process holds its update lock while a fork, renewing as the zygote's children do, takes its own."""
    locks = process_locks()
    names = {(getattr(owner, "__qualname__", ""), attribute) for owner, attribute in locks}
    assert {("MPFuture", "_update_lock"), ("MPFuture", "_initialization_lock"), ("SharedBytes", "_lock")} <= names
    with MPFuture._update_lock:
        pid = os.fork()
        if pid == 0:  # the fork: nothing here may raise into pytest
            try:
                renew(locks)
                os._exit(0 if MPFuture._update_lock.acquire(timeout=3) else 1)
            finally:
                os._exit(2)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the fork waited for a lock this process held"


# Waits for the file argv[2], spins argv[1] s of CPU, says so, then sleeps until killed.
SPIN = (
    "import os, sys, time\nwhile not os.path.exists(sys.argv[2]): time.sleep(0.01)\n"
    "end = time.process_time() + float(sys.argv[1])\nwhile time.process_time() < end: pass\n"
    "print('spun', flush=True)\ntime.sleep(60)\n"
)
# Starts the program argv[2:] in a child, says the child's pid, and sleeps argv[1] s before it exits.
PARENT = (
    "import subprocess, sys, time\nchild = subprocess.Popen([sys.executable, '-c', *sys.argv[2:]])\n"
    "print(child.pid, flush=True)\ntime.sleep(float(sys.argv[1]))\n"
)


def test_a_tests_cpu_counts_processes_killed_together_and_none_that_left(processes, tmp_path):
    """tests/cpu_report.py's count: a child's CPU though it is SIGKILLed with its parent (and so reaped
    by init, which keeps its CPU, not by anything under this process), and not the CPU of a process
    that left this process's tree (orphaned) before it spun."""
    meter = TreeCPU(os.getpid(), period=0.1)

    def parent(stay: float, go: str) -> tuple[subprocess.Popen, int]:
        proc = subprocess.Popen(
            [sys.executable, "-c", PARENT, str(stay), SPIN, "1.0", str(tmp_path / go)],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        return proc, int(proc.stdout.readline())

    meter.start()
    group, child = parent(60, "go")
    try:
        (tmp_path / "go").touch()
        assert group.stdout.readline() == "spun\n"  # the child's, on the pipe it inherited
    finally:
        os.killpg(group.pid, signal.SIGKILL)
        group.wait()
    assert meter.stop() >= 0.9
    meter.start()
    left, orphan = parent(0, "go again")
    try:
        assert left.wait(30) == 0
        (tmp_path / "go again").touch()
        assert left.stdout.readline() == "spun\n"
        assert meter.stop() < 0.5  # the two interpreters' starts
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(orphan, signal.SIGKILL)
