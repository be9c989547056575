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


# hivemind logs a gradient round that failed (no group formed before its deadline, a partner that
# left mid-round) with a full traceback (`logger.exception`). In a swarm that is an expected outcome
# (the replica steps with its own gradient and says so), so it is one warning line here.
EXPECTED_ROUND_FAILURES = ("AllreduceException", "MatchmakingException", "TimeoutError")


class RoundFailureFilter(logging.Filter):
    """Turns hivemind's traceback for an expected failed averaging round into one warning line."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is not None and type(error).__name__ in EXPECTED_ROUND_FAILURES:
            record.msg, record.args = f"averaging round failed: {type(error).__name__}: {error}", ()
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


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
    averager = logging.getLogger("hivemind.averaging.averager")
    if not any(isinstance(f, RoundFailureFilter) for f in averager.filters):
        averager.addFilter(RoundFailureFilter())
