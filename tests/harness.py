"""The test harness: which tests start real processes, and the swarms they share.

A test that starts processes (a `swarm` command, a DHT node, a browser) gets them through a fixture
that says so: `processes`, or any fixture made with `swarm_fixture`, directly or through another
fixture. Such a test is marked `swarm` at collection, so `pytest -m "not swarm"` runs the rest (the
fast tier) and never starts one; a test of the fast tier that starts a process anyway fails and
says which fixture to ask for. Under pytest-xdist the tests of a module that share a module-scoped
process fixture run on one worker (`xdist_group`), so each shared swarm starts once.

`Swarm` is a coordinator, peers and a trainer of one run as child processes: a test makes one in a
function-scoped fixture, or a module shares one (`swarm_fixture(scope="module")`) among tests that
only watch it.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing.process
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from swarm.children import Proc, http, stop_all
from swarm.children import processes as process_table
from swarm.zygote import Zygote, zygote
from tests.processes import ROOT, child, start_coordinator, wait_for_state

TINY = ROOT / "configs" / "tiny.toml"
ACCUMULATION = 2  # tiny.toml: global_batch 16 / micro_batch 8
STARTS_PROCESSES = "_starts_processes"


def swarm_fixture(function: Callable | None = None, **options):
    """`pytest.fixture` for a fixture that starts processes: the tests that use it are marked `swarm`.
    Used bare or with pytest.fixture's options (`scope="module"`)."""

    def make(f: Callable):
        setattr(f, STARTS_PROCESSES, True)
        return pytest.fixture(**options)(f)

    return make(function) if function is not None else make


# torch's shared-memory manager: started (in a session of its own) by the first `share_memory_()` of
# this process, and needed for the process's life. Ended, every shared tensor freed later (hivemind's
# step controls, from a late garbage collection) aborts the process: "Broken pipe" thrown in
# THManagedMapAllocator::close().
KEPT = {"torch_shm_manager"}


def command_name(pid: int) -> str:
    """The process's executable name (Linux keeps its first 15 characters), "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def own_children() -> set[int]:
    """Process groups this process started (`start_new_session`), itself or through its zygote
    (swarm/zygote.py), that are still running; neither the zygote nor the KEPT ones."""
    me, parents = os.getpid(), {os.getpid()}
    if zygote.cache_info().currsize:
        parents.add(zygote().pid())
    return {
        pid
        for pid, state, ppid, group in process_table()
        if ppid in parents
        and group == pid
        and state != "Z"
        and pid not in parents - {me}
        and command_name(pid) not in {name[:15] for name in KEPT}
    }


def end_groups(groups: set[int], timeout: float = 15.0) -> None:
    """SIGTERM each process group, SIGKILL what is left after `timeout`."""
    for group in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while groups & own_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    for group in groups & own_children():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)


@swarm_fixture
def processes() -> Iterator[None]:
    """For a test that starts child processes itself (`tests.processes.child`, `run_cli`, a DHT
    node): marks it `swarm`, and ends every process group it started that is still running at its
    end, so that a failed test leaves nothing eating the cores of the tests after it."""
    before = own_children()
    yield
    left = own_children() - before
    if left:
        end_groups(left)


def starts_processes(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    for name in item.fixturenames:
        for definition in info.name2fixturedefs.get(name, ()):
            if getattr(definition.func, STARTS_PROCESSES, False):
                return True
    return False


def shared_process_scope(item: pytest.Item) -> bool:
    """Whether the test uses a process fixture wider than itself (a module's shared swarm)."""
    info = item._fixtureinfo
    return any(
        getattr(d.func, STARTS_PROCESSES, False) and d.scope != "function"
        for name in item.fixturenames
        for d in info.name2fixturedefs.get(name, ())
    )


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if starts_processes(item):
            item.add_marker(pytest.mark.swarm)
            if shared_process_scope(item):
                item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    items[:] = spread(items)


def spread(items: list[pytest.Item]) -> list[pytest.Item]:
    """`items` with each module's tests spread evenly over the run, in their order within the module
    (the tests of one xdist group together), the tests that start processes first and the fast tier
    last. The workers take tests from one queue, in this order. In file order both ran the same module
    at once: tests/test_averaging.py's replicas waiting out timeouts left the 2 cores a third busy for
    two minutes, where beside another module's swarm a wait costs nothing. With the fast tier spread
    too, a swarm test came last and one worker ran it alone for 35 s; last, the fast tests (about
    half a minute on each worker) fill that time."""
    return _spread([i for i in items if i.get_closest_marker("swarm")]) + _spread(
        [i for i in items if not i.get_closest_marker("swarm")]
    )


def _spread(items: list[pytest.Item]) -> list[pytest.Item]:
    units: dict[tuple[str, str], list[pytest.Item]] = {}  # (file, group or test) -> its tests, in order
    for item in items:
        group = item.get_closest_marker("xdist_group")
        unit = group.args[0] if group is not None and group.args else item.nodeid
        units.setdefault((item.nodeid.split("::")[0], unit), []).append(item)
    by_file: dict[str, list[list[pytest.Item]]] = {}
    for (path, _), tests in units.items():
        by_file.setdefault(path, []).append(tests)
    # Each unit at the middle of its share of its file's run: the k-th of n at (k + 0.5) / n.
    placed = sorted(
        ((k + 0.5) / len(file_units), order, k)
        for order, file_units in enumerate(by_file.values())
        for k in range(len(file_units))
    )
    files = list(by_file.values())
    return [item for _, order, k in placed for item in files[order][k]]


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (the default, pyproject.toml): one worker per core this process may run on. Two per
    core, for swarm tests that mostly wait, loaded 2 cores enough to fail timing-bound tests."""
    return len(os.sched_getaffinity(0))


class StartedAProcess(RuntimeError):
    pass


@contextlib.contextmanager
def no_processes(item: pytest.Item) -> Iterator[None]:
    """While a test of the fast tier runs, starting a process or a DHT node fails with a message that
    names the fixture to ask for."""

    def refuse(what: str) -> None:
        raise StartedAProcess(
            f"{item.nodeid} starts {what}, but asks for no process fixture: ask for `processes` (or a "
            "fixture made with tests.harness.swarm_fixture), which marks it `swarm` and ends what it leaves"
        )

    execute_child = subprocess.Popen._execute_child
    start = multiprocessing.process.BaseProcess.start
    spawn = Zygote.spawn

    def guarded_execute_child(self, args, *rest, **kwargs):
        refuse(f"a process ({args if isinstance(args, str) else ' '.join(map(str, args))[:200]})")

    def guarded_start(self):
        refuse(f"a child process ({type(self).__name__})")

    def guarded_spawn(self, args, *rest, **kwargs):
        refuse(f"a process (swarm {' '.join(args)[:200]})")

    subprocess.Popen._execute_child = guarded_execute_child
    multiprocessing.process.BaseProcess.start = guarded_start
    Zygote.spawn = guarded_spawn
    try:
        yield
    finally:
        subprocess.Popen._execute_child = execute_child
        multiprocessing.process.BaseProcess.start = start
        Zygote.spawn = spawn


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    if item.get_closest_marker("swarm") is not None:
        return (yield)
    with no_processes(item):
        return (yield)


@pytest.fixture(scope="module", autouse=True)
def _nothing_left_running() -> Iterator[None]:
    """After a module (its shared fixtures torn down), no process group it started is still running."""
    before = own_children()
    yield
    left = own_children() - before
    if left:
        print(f"\nprocess groups left running, now ended: {sorted(left)}", file=sys.stderr)
        end_groups(left)


def own_host(n: int) -> str:
    """The loopback address of the `n`-th peer's own machine (127.0.0.1 is the coordinator's)."""
    return f"127.0.0.{2 + n}"


class Swarm:
    def __init__(self, tmp: Path, config: Path = TINY, coordinator_args: tuple[str, ...] = ()):
        """`coordinator_args`: more options for `swarm coordinator` (they win over the defaults)."""
        self.tmp, self.config, self.coordinator_args = tmp, config, coordinator_args
        self.coordinator, self.url = start_coordinator(config, tmp / "coordinator.log", *coordinator_args)
        self.peers: dict[str, Proc] = {}
        self.trainer: Proc | None = None

    def add_peer(self, name: str, stage: int | str = "auto", *extra: str, rebalance: bool = False) -> Proc:
        """A peer; pinned to its stage unless the test is about rebalancing (moves would blur the rest).
        Each peer listens on a loopback address of its own (127.0.0.2, .3, ...) unless `extra` names a
        `--host`: a machine of its own, as spot checks count one vote per host."""
        if not rebalance:
            extra = ("--no-rebalance", *extra)
        if "--host" not in extra:
            extra = ("--host", own_host(len(self.peers)), *extra)
        proc = child(
            [
                "peer",
                "--coordinator",
                self.url,
                "--stage",
                str(stage),
                "--public-name",
                name,
                "--threads",
                "1",
                "--log-steps",
                str(self.tmp / f"{name}.steps"),
                *extra,
            ],
            self.tmp / f"{name}.log",
        )
        self.peers[name] = proc
        return proc

    def wait_online(self, names: list[str], timeout: float = 90) -> dict:
        """The state once every peer in `names` is online; when one never is, the failure says whether
        it is still running and ends with its log."""
        try:
            return wait_for_state(self.url, lambda s: set(names) <= online_names(s), timeout)
        except AssertionError as e:
            missing = set(names) - online_names(state(self.url))
            logs = "".join(
                f"\n--- {n} ({'running' if self.peers[n].alive() else f'exited {self.peers[n].popen.returncode}'}):\n"
                f"{self.peers[n].output()[-4000:]}"
                for n in sorted(missing)
                if n in self.peers
            )
            raise AssertionError(f"{e}\nnot online: {sorted(missing)}{logs}") from None

    def train(self, steps: int, inflight: int = 4, timeout: float = 20, *extra: str) -> Proc:
        self.trainer = child(
            [
                "train",
                "--coordinator",
                self.url,
                "--steps",
                str(steps),
                "--inflight",
                str(inflight),
                "--call-timeout",
                str(timeout),
                "--log-json",
                str(self.tmp / "train.jsonl"),
                *extra,
            ],
            self.tmp / "trainer.log",
        )
        return self.trainer

    def records(self) -> list[dict]:
        path = self.tmp / "train.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def wait_steps(self, count: int, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while len(self.records()) < count:
            assert self.trainer.popen.poll() is None or len(self.records()) >= count, self.trainer.output()[-3000:]
            assert time.monotonic() < deadline, f"trainer reached {len(self.records())} of {count} steps"
            time.sleep(0.2)

    def finish_training(self, timeout: float = 300) -> list[dict]:
        assert self.trainer.popen.wait(timeout) == 0, self.trainer.output()[-3000:]
        return self.records()

    def applied(self) -> list[dict]:
        """Every optimizer step every peer took, with the microbatches it applied."""
        steps = []
        for name in self.peers:
            path = self.tmp / f"{name}.steps"
            if path.exists():
                steps += [dict(json.loads(line), peer=name) for line in path.read_text().splitlines()]
        return steps

    def close(self) -> None:
        """Ends every process of the swarm: SIGKILL to every group at once. What the test asserts is
        done by then, and a graceful stop (each peer leaving its stage, its averagers shutting down)
        cost a 2 x 2 swarm about 2 s and 3 CPU-s of its 2 cores, in the teardown of every swarm test;
        the graceful stop has tests of its own (test_coordinator, test_demo, test_peer_moves). Stopped
        one by one, a stop that raised left the rest running (and eating the CPU) through the tests after."""
        procs = [p for p in [self.trainer, *self.peers.values(), self.coordinator] if p is not None]
        for p in procs:
            if p.alive():
                p.signal_group(signal.SIGKILL)
        stop_all(procs)


def assert_no_gradient_applied_twice(swarm: Swarm) -> None:
    for stage in (0, 1):
        ids = [mb for step in swarm.applied() if step["stage"] == stage for mb in step["microbatches"]]
        assert len(ids) == len(set(ids)), f"stage {stage}: a microbatch was applied twice"


def online_names(state: dict) -> set[str]:
    return {p["public_name"] for s in state["stages"] for p in s["peers"] if p["state"] == "online"}


def peer_record(state: dict, name: str) -> dict | None:
    return next((p for s in state["stages"] for p in s["peers"] if p["public_name"] == name), None)


def state(url: str) -> dict:
    return http().get(f"{url}/api/v1/state").json()
