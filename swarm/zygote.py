"""`swarm` commands started by forking a process that imported torch and hivemind once.

A `swarm` command's imports alone take about 3 s of CPU (torch, hivemind and the scipy it pulls in).
Whoever starts many commands on one machine (the tests and the benchmarks start hundreds; see
`swarm.children.Proc`, which forks from here when SWARM_ZYGOTE=1) spends a large part of its cores on
those imports. A zygote process imports them once; each command is a fork of it that becomes
`python -m swarm.cli ARGS` (runpy, as `-m` does), in a session of its own, with its environment,
working folder and log, optionally inside a network namespace (as `ip netns exec NS` would put it),
and exits as that command would (atexit handlers, exit status, signals). The zygote holds no thread
when it forks (checked), so the children are as clean as a new interpreter. The zygote ends when the
process that started it closes its end of the pipe (it exits, or is killed).

Protocol, one JSON object a line: the starting process writes {"args", "cwd", "env", "log", "err", "netns"};
the zygote answers {"started": pid} once the child leads a process group of its own, and later, for each
child, {"exited": pid, "code": returncode}.

A process that starts another that starts commands too (a test running `python -m benchmarks NAME`)
can lend it a zygote: {"pipes": [IN, OUT]} forks one more zygote from this one, already imported, that
serves whoever opens the FIFO IN to write and OUT to read; that process finds them in SWARM_ZYGOTE_PIPES
(`Zygote.lend`), and its `zygote()` takes it instead of starting one (6 s of CPU in imports).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import json
import multiprocessing
import multiprocessing.synchronize
import os
import queue
import random
import runpy
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterable
from pathlib import Path

import numpy

# torch._dynamo: torch.optim's optimizers import it when the first one is made (`_disable_dynamo`), so
# every peer did, after the fork: 1.2 to 3 s of CPU each, most of a forked peer's start.
PRELOAD = ("torch", "torch._dynamo", "hivemind", "swarm.cli", "peer.daemon", "coordinator.app", "swarm.trainer.loop")
ROOT = Path(__file__).resolve().parent.parent
PIPES_ENV = "SWARM_ZYGOTE_PIPES"  # "IN:OUT": the FIFOs of a zygote lent to this process (`Zygote.lend`)


# -- in the zygote ---------------------------------------------------------------------------------


# What a module may create at import and share with every process forked from the one that imported
# it, and how a fork makes one of its own.
RENEWED = {
    multiprocessing.synchronize.Lock: multiprocessing.Lock,
    multiprocessing.synchronize.RLock: multiprocessing.RLock,
    multiprocessing.synchronize.Event: multiprocessing.Event,
}
SHARED = (multiprocessing.synchronize.SemLock, multiprocessing.synchronize.Event, multiprocessing.synchronize.Condition)


def process_locks() -> list[tuple[object, str]]:
    """(owner, attribute) of every multiprocessing lock or event that an imported module holds, in
    itself or in a class of its own: hivemind makes several at import (MPFuture's update lock,
    SharedBytes', its async executor's). Made once in the zygote, one lock would serve every command
    forked from it: a peer killed while it held MPFuture's update lock left the next commands' DHT
    nodes waiting for it for ever (their coordinators never started)."""
    found = []
    with warnings.catch_warnings():  # reading a deprecated module attribute (torch's) warns
        warnings.simplefilter("ignore")
        for module in list(sys.modules.values()):
            found += _locks_of(module)
    return found


def _locks_of(module) -> list[tuple[object, str]]:
    """`process_locks` of one module."""
    try:
        names = vars(module)
    except TypeError:
        return []
    found = []
    owners = [module, *(v for v in names.values() if isinstance(v, type) and v.__module__ == module.__name__)]
    for owner in owners:
        for attribute, value in list(vars(owner).items()):
            if isinstance(value, SHARED):
                if type(value) not in RENEWED:
                    raise SystemExit(f"zygote: {owner!r}.{attribute} is a {type(value).__name__} it cannot renew")
                found.append((owner, attribute))
    return found


def renew(locks: list[tuple[object, str]]) -> None:
    """In a fork: a lock or event of its own in place of each of `locks` (`process_locks`)."""
    for owner, attribute in locks:
        setattr(owner, attribute, RENEWED[type(getattr(owner, attribute))]())


# setns(2)'s flag for a network namespace (linux/sched.h).
CLONE_NEWNET = 0x40000000


def enter_netns(name: str) -> None:
    """Move this (single-threaded) process into the network namespace `name`, as `ip netns exec`
    does. Python 3.11 has no os.setns (3.12 does), hence libc's."""
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into network namespace {name}: {os.strerror(errno)}")
    finally:
        os.close(fd)


def become(request: dict, locks: list[tuple[object, str]], leads: int) -> None:
    """In a fresh fork: become `python -m swarm.cli ARGS` and never return (SystemExit unwinds the
    zygote's loop, so the interpreter exits as that command's would; so does an error here). `leads`:
    the pipe it closes once it leads a process group of its own."""
    renew(locks)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()
    os.close(leads)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
    log = os.open(request["log"], flags)
    err = os.open(request["err"], flags) if request.get("err") else log
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(err, 2)
    for fd in {log, err, null}:
        os.close(fd)
    if request.get("netns"):
        enter_netns(request["netns"])
    for stream in (sys.stdout, sys.stderr):  # PYTHONUNBUFFERED, as the command's environment asks
        stream.reconfigure(write_through=True, line_buffering=True)
    # A new interpreter seeds these from the OS: forks of one zygote would all draw the same numbers
    # (peers' randomised timing, jitter, spot checks) without this. torch's default seed is fixed anyway.
    random.seed()
    numpy.random.seed()
    sys.argv = [str(ROOT / "swarm" / "cli.py"), *request["args"]]
    sys.modules.pop("swarm.cli", None)  # `-m` runs the module as __main__, not the imported copy
    runpy.run_module("swarm.cli", run_name="__main__", alter_sys=True)
    sys.exit(0)


def answer(message: dict) -> None:
    # os.write on the pipe: one short line is written whole, also from the SIGCHLD handler.
    os.write(1, (json.dumps(message) + "\n").encode())


def reap(signum, frame) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        answer({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def serve() -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    if threading.active_count() != 1:
        raise SystemExit(f"zygote: {threading.active_count()} threads after the imports; a fork would be unsafe")
    _serve(sys.stdin, process_locks())


def _serve(requests: Iterable[str | bytes], locks: list[tuple[object, str]]) -> None:
    signal.signal(signal.SIGCHLD, reap)
    answer({"ready": os.getpid()})
    for line in requests:
        request = json.loads(line)
        # "started" only once the child leads its process group (os.setsid), so that whoever signals the
        # group (os.killpg(pid), as swarm.children.Proc does) reaches it: a SIGTERM sent right after the
        # start found no group, was dropped, and the peer went on to serve until SIGKILLed.
        led, leads = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(led)
            if "pipes" in request:
                lent(request["pipes"], locks, leads)
            become(request, locks, leads)
        os.close(leads)
        os.read(led, 1)  # b"" once the child closed its end (or died)
        os.close(led)
        answer({"started": pid})


def lent(pipes: list[str], locks: list[tuple[object, str]], leads: int) -> None:
    """In a fresh fork: a zygote for whoever opens the FIFOs `pipes` (IN to write requests, OUT to read
    the answers), in a session of its own; it exits once that process closed IN. The commands it forks
    unwind through here as through `serve` (their SystemExit passes)."""
    me = os.getpid()
    os.setsid()
    os.close(leads)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # not the lending zygote's pipe: its own requests are not this one's
    os.close(null)
    try:
        with open(pipes[0], "rb") as requests:  # blocks until the borrower opens it to write
            out = os.open(pipes[1], os.O_WRONLY)
            os.dup2(out, 1)
            os.close(out)
            _serve(requests, locks)
    finally:
        if os.getpid() == me:
            os._exit(0)


# -- in the starting process ---------------------------------------------------------------------------


class Forked:
    """A child of the zygote, with the part of `subprocess.Popen` that swarm.children.Proc's users use."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]):
        self.zygote, self.pid, self.args = zygote, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            with self.zygote.changed:
                self.zygote.changed.wait(0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)


class Zygote:
    """A zygote this process started (a new interpreter), or, with `pipes` (IN, OUT), the one lent to
    it through those FIFOs (`lend`)."""

    def __init__(self, pipes: tuple[str, str] | None = None):
        self.proc = None
        if pipes is None:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "swarm.zygote"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                cwd=ROOT,
                start_new_session=True,
            )
            self.requests, answers = self.proc.stdin, self.proc.stdout
        else:
            self.requests = open(pipes[0], "wb")  # noqa: SIM115 (closed by `close`); the order `lent` opens them
            answers = open(pipes[1], "rb")  # noqa: SIM115 (read to its end by `_read`)
        self.exits: dict[int, int] = {}
        self.started: queue.Queue = queue.Queue()
        self.changed = threading.Condition()
        self.lock = threading.Lock()
        self.ended = False
        threading.Thread(target=self._read, args=(answers,), name="zygote", daemon=True).start()
        self._pid = self.started.get(timeout=300)
        if self._pid is None:
            raise RuntimeError("the zygote exited before it was ready")

    def _read(self, answers) -> None:
        for line in answers:
            message = json.loads(line)
            if "exited" in message:
                with self.changed:
                    self.exits[message["exited"]] = message["code"]
                    self.changed.notify_all()
            else:
                self.started.put(message.get("started", message.get("ready")))
        self.ended = True
        self.started.put(None)
        with self.changed:
            self.changed.notify_all()

    def _request(self, request: dict) -> int:
        """Write `request`; the pid it started."""
        with self.lock:
            if self.ended or (self.proc is not None and self.proc.poll() is not None):
                raise RuntimeError("the zygote exited; no command can be started")
            self.requests.write((json.dumps(request) + "\n").encode())
            self.requests.flush()
            pid = self.started.get(timeout=60)
        if pid is None:
            raise RuntimeError("the zygote exited while starting a command")
        return pid

    def lend(self, folder: Path) -> tuple[dict[str, str], Forked]:
        """A zygote forked from this one for a process that this one is about to start: the environment
        entry by which that process's `zygote()` takes it, and the lent zygote's process (to be ended
        once that process has: one that never took it waits for it with no end)."""
        pipes = [folder / "zygote.in", folder / "zygote.out"]
        for path in pipes:
            os.mkfifo(path)
        pid = self._request({"pipes": [str(path) for path in pipes]})
        return {PIPES_ENV: ":".join(str(path) for path in pipes)}, Forked(self, pid, ["zygote"])

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        else:
            self.requests.close()  # the lent zygote's end of its requests: it exits

    def exit_code(self, pid: int) -> int | None:
        return self.exits.get(pid)

    def spawn(
        self,
        args: list[str],
        log: Path,
        cwd: Path,
        env: dict[str, str],
        netns: str | None = None,
        err: Path | None = None,
    ) -> Forked:
        """`python -m swarm.cli ARGS` forked, in `cwd` with exactly `env` (less a lent zygote's pipes,
        which are this process's), output appended to `log` (its standard error to `err` when given);
        with `netns`, inside that network namespace."""
        env = {k: v for k, v in env.items() if k != PIPES_ENV}
        request = {"args": args, "cwd": str(cwd), "env": env, "log": str(log), "err": err and str(err), "netns": netns}
        return Forked(self, self._request(request), args)

    def pid(self) -> int:
        return self._pid


@functools.cache
def zygote() -> Zygote:
    """This process's zygote: the one lent to it (SWARM_ZYGOTE_PIPES), else one started at first use;
    ended with the process."""
    pipes = os.environ.pop(PIPES_ENV, None)
    z = Zygote(tuple(pipes.split(":", 1)) if pipes else None)
    import atexit

    atexit.register(z.close)
    return z


if __name__ == "__main__":
    serve()
