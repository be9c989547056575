"""Logging (swarm/logs.py): one setup in the CLI. A real stage worker's status lines are log lines
with the time, the level and the module; `--log-level` hides the less severe ones; the libraries'
chatter stays below WARNING; a level that does not exist is refused, naming the flag."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.ready import PeerReady, wait_ready
from tests.conftest import run_cli
from tests.processes import ROOT, child

TINY = ROOT / "configs" / "tiny.toml"
TIME = r"[A-Z][a-z][a-z] [ \d]\d \d\d:\d\d:\d\d"  # as logging writes it: Nov 24 14:12:34


def log_line(level: str, module: str, text: str) -> str:
    return rf"{TIME} {level} {module}: {text}"


def serve_by_hand(tmp_path: Path, *extra: str) -> str:
    """What a by-hand stage worker printed once it served (its ready file is written after the log line)."""
    proc = child(
        ["peer", "--config", str(TINY), "--stage", "0", "--port", "0", "--threads", "1", *extra],
        tmp_path / f"peer{len(extra)}.log",
        ready=True,
    )
    try:
        wait_ready(proc, PeerReady, timeout=60)
    finally:
        assert proc.stop() == 0, proc.output()[-3000:]
    return proc.output()


def test_status_lines_are_log_lines_and_the_level_hides_them(processes, tmp_path: Path):
    shown = serve_by_hand(tmp_path)
    text = r"stage 0/2 of run '\S+' .* serving on 127\.0\.0\.1:\d+"
    serving = log_line("INFO", r"peer\.run", text)
    assert re.search(serving, shown), shown[-3000:]

    quiet = serve_by_hand(tmp_path, "--log-level", "warning")
    assert "serving on" not in quiet, quiet[-3000:]
    assert "stopped after" in quiet  # the closing summary is output, not a log line


def test_the_libraries_stay_at_warning_unless_debugging(processes):
    script = (
        "import logging, sys; from swarm.logs import setup_logging; setup_logging(sys.argv[1]); "
        "logging.getLogger('httpx').info('library info'); logging.getLogger('httpx').warning('library warning'); "
        "logging.getLogger('peer.daemon').info('own info'); logging.getLogger('peer.daemon').debug('own debug')"
    )

    def stderr(level: str) -> str:
        args = [sys.executable, "-c", script, level]
        run = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert run.returncode == 0, run.stderr
        return run.stderr

    info = stderr("info")
    assert "own info" in info and "library warning" in info
    assert "library info" not in info and "own debug" not in info
    debug = stderr("debug")
    assert all(text in debug for text in ("own info", "own debug", "library info", "library warning"))
    assert "own info" not in stderr("warning")


@pytest.mark.parametrize(
    "command", [["peer", "--config", str(TINY), "--stage", "0"], ["coordinator", "--config", str(TINY)]]
)
def test_an_unknown_log_level_is_refused_naming_the_flag(processes, command: list[str]):
    run = run_cli(*command, "--log-level", "loud", timeout=60)
    assert run.returncode == 2 and "--log-level" in run.stderr and "loud" in run.stderr, run.stderr


def test_a_failed_averaging_round_is_one_warning_line_and_other_errors_keep_their_traceback(processes):
    """hivemind logs a round that found no group with logger.exception; in a swarm that is expected
    (the replica steps alone), so a volunteer's log shows one warning line, not a traceback."""
    script = (
        "import sys; from swarm.logs import setup_logging; setup_logging('info')\n"
        "from hivemind.averaging.partition import AllreduceException\n"
        "from hivemind.averaging import averager\n"
        "for error in (AllreduceException('Averaging step failed: could not find a group'), ValueError('a bug')):\n"
        "    try:\n"
        "        raise error\n"
        "    except Exception as e:\n"
        "        averager.logger.exception(e)\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert run.returncode == 0, run.stderr
    failed = "averaging round failed: AllreduceException: Averaging step failed: could not find a group"
    assert failed in run.stderr, run.stderr
    round_line = next(line for line in run.stderr.splitlines() if failed in line)
    assert "WARN" in round_line, round_line
    # The traceback that is left is the ValueError's, and only it.
    assert run.stderr.count("Traceback") == 1 and "ValueError: a bug" in run.stderr, run.stderr
