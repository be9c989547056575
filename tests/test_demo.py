"""`swarm demo` end to end: real child processes, a real export, and nothing left running afterwards."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarm.demo import port_free
from tests.processes import ROOT, free_port, survivors


def demo(tmp: Path, *args: str, sigint_ignored: bool = False) -> subprocess.Popen:
    """`sigint_ignored`: started as a script's background job is, with SIGINT ignored on entry."""
    out = open(tmp / "demo.out", "w")  # noqa: SIM115 (the test reads it back; closed with the process)

    def ignore_sigint() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    return subprocess.Popen(
        [sys.executable, "-m", "swarm.cli", "demo", *args],
        stdout=out,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
        preexec_fn=ignore_sigint if sigint_ignored else None,
    )


def children_gone(workdir: Path) -> dict[str, list[str]]:
    """Every child group the demo started, with whatever of it still runs (nothing, when all is well)."""
    pids = json.loads((workdir / "children.json").read_text())
    return {name: left for name, pid in pids.items() if (left := survivors(pid, timeout=2))}


def test_demo_trains_exports_samples_and_stops_every_child(processes, tmp_path: Path):
    port, workdir = free_port(), tmp_path / "demo"
    proc = demo(tmp_path, "--steps", "8", "--port", str(port), "--workdir", str(workdir))
    try:
        assert proc.wait(timeout=300) == 0, (tmp_path / "demo.out").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = (tmp_path / "demo.out").read_text()
    assert out.splitlines()[0] == f"dashboard: http://127.0.0.1:{port}/"
    summary = out[out.index("\nsummary\n") :]
    rows = dict(re.findall(r"^  (\S[^\n]*?)  +(\S[^\n]*)$", summary, re.M))
    assert rows["steps"] == "8"
    # 8 steps learn something (a uniform guess is ln 256 = 5.55); the default 200 steps go well below the
    # unigram baseline (README), which is too long for a test
    assert float(rows["final val loss"]) < math.log(256) - 1.5
    assert 3.0 < float(rows["unigram baseline"].split()[0]) < 3.4
    # The trainer's own running total at its last step (its DHT record may still say 0 after a short run).
    logged = [json.loads(line) for line in (workdir / "train.jsonl").read_text().splitlines()]
    assert int(rows["wire bytes"].replace(",", "")) == logged[-1]["wire_bytes"] > 0
    assert "sample from the exported model" in out
    config = json.loads((workdir / "model" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 4
    assert set(json.loads((workdir / "children.json").read_text())) == {"coordinator", "peer-0", "peer-1", "trainer"}
    assert children_gone(workdir) == {}
    assert port_free(port)
    assert f"port {port} is free" in out


def test_ctrl_c_stops_every_child_and_frees_the_port(processes, tmp_path: Path):
    port, workdir = free_port(), tmp_path / "demo"
    # Started with SIGINT ignored, as a script's `swarm demo &` is: Ctrl-C (a SIGINT) must still stop it.
    args = ("--steps", "500", "--port", str(port), "--workdir", str(workdir), "--replicas", "1")
    proc = demo(tmp_path, *args, sigint_ignored=True)
    try:
        deadline = time.monotonic() + 240
        log = workdir / "train.jsonl"
        while not (log.exists() and len(log.read_text().splitlines()) >= 2):
            assert proc.poll() is None, (tmp_path / "demo.out").read_text()[-4000:]
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.5)
        os.kill(proc.pid, signal.SIGINT)  # what Ctrl-C in its terminal sends to the demo
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = (tmp_path / "demo.out").read_text()
    assert "interrupted" in out
    assert children_gone(workdir) == {}
    assert port_free(port)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--stages", "9"], "stages.count: 9 stages but only 4 layers"),
        (["--replicas", "0"], "--replicas"),
        (["--config", "no/such.toml"], "no/such.toml"),
    ],
)
def test_bad_options_are_refused_naming_them(processes, tmp_path: Path, args: list[str], named: str):
    run = subprocess.run(
        [sys.executable, "-m", "swarm.cli", "demo", "--workdir", str(tmp_path / "w"), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert run.returncode == 2 and named in run.stderr, run.stderr


def test_a_busy_port_and_a_foreign_folder_are_refused_and_left_alone(processes, tmp_path: Path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        run = subprocess.run(
            [sys.executable, "-m", "swarm.cli", "demo", "--port", str(port), "--workdir", str(tmp_path / "w")],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )
        assert run.returncode == 2 and f"--port {port}" in run.stderr, run.stderr
    port = free_port()
    run = subprocess.run(
        [sys.executable, "-m", "swarm.cli", "demo", "--port", str(port), "--workdir", str(foreign)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert run.returncode == 2 and "not made by swarm demo" in run.stderr, run.stderr
    assert (foreign / "notes.txt").read_text() == "keep me"
