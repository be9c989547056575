import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# One torch thread in every process the tests start (the xdist workers, the zygote and every command
# it forks): the suite keeps each core busy with processes of its own, and a torch op split over two
# threads then spins, waiting for a thread that is not running. `swarm train --local` (tiny.toml, 40
# steps) beside one busy loop on 2 cores: 30 s of CPU with torch's 2 threads, 11 s with 1. Set before
# anything imports torch; a value set by the caller is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The harness's hooks and fixtures: marking the tests that start processes `swarm`, refusing a process
# to a test of the fast tier, and ending what a module leaves running (tests/harness.py).
from swarm.zygote import zygote
from tests.harness import (  # noqa: F401
    _nothing_left_running,
    processes,
    pytest_collection_modifyitems,
    pytest_runtest_protocol,
    pytest_xdist_auto_num_workers,
)

ROOT = Path(__file__).resolve().parent.parent


def pytest_configure(config: pytest.Config) -> None:
    # SWARM_TEST_CPU=FILE: each test's CPU seconds, with those of every process it ran, into FILE.
    from tests import cpu_report

    config.pluginmanager.register(cpu_report, "swarm-test-cpu")


CONFIGS = ROOT / "configs"


@pytest.fixture
def tiny_config_path() -> Path:
    return CONFIGS / "tiny.toml"


def run_cli(*args: str, timeout: float = 300, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run the `swarm` command line as a user would, with this process's environment, and capture its
    output, as `subprocess.run` would (a test that calls it asks for the `processes` fixture). It is
    forked from the zygote (swarm/zygote.py), which runs it as a new interpreter would, without 3 s of
    imports; a command that outlives `timeout` is killed with its process group (TimeoutExpired)."""
    command = [sys.executable, "-m", "swarm.cli", *args]
    with tempfile.TemporaryDirectory(prefix="swarm-cli-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        proc = zygote().spawn(list(args), out, cwd or ROOT, dict(os.environ), err=err)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        return subprocess.CompletedProcess(command, code, out.read_text(), err.read_text())
