"""Logging: library code logs through `logging.getLogger(__name__)`; the CLI calls `setup_logging`
once (`--log-level`). What a user reads as the command's result (progress bars, summaries, tables)
is printed, not logged.

Lines go to stderr, as hivemind's do, prefixed by the time, the level and the module. Only this
project's loggers take the chosen level: the libraries it uses stay at WARNING, where httpx does not
log every request to the coordinator (with `--log-level debug`, they log at DEBUG too).
"""

from __future__ import annotations

import logging
import sys

LEVELS = ("debug", "info", "warning", "error")
PACKAGES = ("swarm", "peer", "coordinator", "benchmarks")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%b %d %H:%M:%S"


def setup_logging(level: str = "info") -> None:
    """Send log records to stderr: this project's at `level` and above, the libraries' at WARNING and
    above (at DEBUG too when `level` is debug)."""
    if level not in LEVELS:
        raise ValueError(f"log level {level!r}: choose one of {', '.join(LEVELS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_swarm", False)]:
        root.removeHandler(old)
    handler._swarm = True  # type: ignore[attr-defined]  # ours to replace when called again
    root.addHandler(handler)
    numeric = getattr(logging, level.upper())
    root.setLevel(logging.DEBUG if numeric == logging.DEBUG else logging.WARNING)
    for package in PACKAGES:
        logging.getLogger(package).setLevel(numeric)
