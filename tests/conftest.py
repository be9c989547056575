import subprocess
import sys
from pathlib import Path

import pytest

# The harness's hooks and fixtures: marking the tests that start processes `swarm`, refusing a process
# to a test of the fast tier, and ending what a module leaves running (tests/harness.py).
from tests.harness import (  # noqa: F401
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
