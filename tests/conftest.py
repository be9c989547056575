import os
import subprocess
import sys
from pathlib import Path

# One torch thread in every process of the suite, this one and all it starts (before torch is first
# imported): the suite runs two workers a core, each with a swarm's processes, and torch's OpenMP
# threads spin-wait on the cores they share (2 steps of tiny.toml in a benchmark's smoke run took
# 168 s with torch's default of a thread a core, and 8.6 s with one).
os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402

# The harness's hooks and fixtures: marking the tests that start processes `swarm`, refusing a process
# to a test of the fast tier, and ending what a module leaves running (tests/harness.py).
from tests.harness import (  # noqa: F401, E402
    _nothing_left_running,
    processes,
    pytest_collection_modifyitems,
    pytest_runtest_protocol,
    pytest_xdist_auto_num_workers,
)

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"


@pytest.fixture
def tiny_config_path() -> Path:
    return CONFIGS / "tiny.toml"


def run_cli(*args: str, timeout: float = 300, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run the `swarm` command line in a fresh interpreter, as a user would (a test that calls it asks
    for the `processes` fixture)."""
    return subprocess.run(
        [sys.executable, "-m", "swarm.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd or ROOT,
    )
