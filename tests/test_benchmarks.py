"""Every benchmark runs as the README says (`python -m benchmarks NAME`), at a tiny size.

Each runs in a fresh interpreter from the repository root, with rows sent to a file of the test's
(`--results`): benchmarks/results.md holds only real measurements and must not change. The sizes
are the smallest that still go through every phase of each benchmark (a kill, a restart, both
codecs of a comparison); what the rows say at this size is not checked, only that one is written.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

from benchmarks.__main__ import BENCHMARKS
from tests.conftest import ROOT

LOGS = ("--log-dir", "{tmp}/logs")  # the benchmarks that start processes keep their logs with the test
TINY = {
    "averaging": ["--steps", "3", "--codecs", "none", "--every", "1", "--tail", "2", *LOGS],
    "chaos": [
        *("--stages", "2", "--per-stage", "2", "--steps", "6", "--no-baseline"),
        *("--kill-min-s", "3", "--kill-max-s", "4", "--coordinator-at", "2", "--coordinator-down-s", "2"),
        *("--freeze-at", "5", "--freeze-s", "2", "--timeout-s", "240", *LOGS),
    ],
    "coordinator": ["--stages", "2", "--peers", "10", "--requests", "5", "--timeout-s", "60", *LOGS],
    "failover": ["--steps", "20", "--warmup-s", "3", "--settle-s", "2", "--window", "2", "--hold", "2", *LOGS],
    "fuzz": ["--cases", "30", *LOGS],
    "local": ["--config", "configs/tiny.toml", "--steps", "3", "--warmup", "1"],
    "pipeline": ["--config", "configs/tiny.toml", "--steps", "2", "--warmup", "1", "--codecs", "none,int8"],
    "rebalance": ["--delays", "0,0.05", "--start", "0,0", "--period", "1", "--hold", "1", "--timeout-s", "90", *LOGS],
    "verify": ["--steps", "3", "--repeat", "1", "--tail", "2", *LOGS],
    "wire": ["--reps", "2", "--warmup", "1", "--codecs", "bf16", "--modules", "noop", "--batch", "2"],
}

# A row of any benchmark's table: "| date | machine | ...".
ROW_START = "| 20"


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_every_benchmark_has_a_smoke_run():
    assert set(TINY) == set(BENCHMARKS)


@pytest.mark.parametrize("name", sorted(TINY))
def test_benchmark_runs_at_a_tiny_size_and_writes_a_row_elsewhere(name, tmp_path):
    shipped = ROOT / "benchmarks" / "results.md"
    before = digest(shipped)
    results = tmp_path / "results.md"
    env = {k: v for k, v in os.environ.items() if k != "USE_LEGACY_BFLOAT16"}  # as a new shell has it
    env["PYTHONUNBUFFERED"] = "1"
    options = [arg.format(tmp=tmp_path) for arg in TINY[name]]
    args = [sys.executable, "-m", "benchmarks", "--results", str(results), name, *options]
    done = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env, timeout=420)
    assert done.returncode == 0, f"python -m benchmarks {name} exited {done.returncode}:\n{done.stderr[-3000:]}"
    rows = [line for line in results.read_text().splitlines() if line.startswith(ROW_START)]
    assert rows, f"no row in {results}:\n{results.read_text()}"
    assert f"appended to {results}" in done.stdout
    assert digest(shipped) == before, "the smoke run wrote to benchmarks/results.md"
