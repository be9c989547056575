import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"


@pytest.fixture
def tiny_config_path() -> Path:
    return CONFIGS / "tiny.toml"


def run_cli(*args: str, timeout: float = 300, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run the `swarm` command line in a fresh interpreter, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "swarm.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd or ROOT,
    )
