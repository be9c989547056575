"""benchmarks/results.md: one table per benchmark, one row per measurement, newest last."""

from __future__ import annotations

import datetime as dt
import os
import platform
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results.md"
_target = RESULTS  # where rows go in this process: `write_to` points them elsewhere (smoke runs)


def write_to(path: Path) -> None:
    """Send this process's rows (and the files beside them, such as plots) to `path` instead."""
    global _target
    _target = Path(path)


def target() -> Path:
    """The results file rows go to now."""
    return _target


def machine() -> str:
    """A short description of where the numbers were taken."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    desc = f"{os.cpu_count()} cores {cpu}"
    if torch.cuda.is_available():
        desc = f"{torch.cuda.get_device_name(0)}; {desc}"
    return desc


def append_row(section: str, columns: list[str], values: list, path: Path | None = None) -> str:
    """Append one row under `## section` (creating the section and its header when new)."""
    path = path or _target
    row = "| " + " | ".join([dt.date.today().isoformat(), machine(), *map(str, values)]) + " |"
    header = ["date", "machine", *columns]
    text = path.read_text() if path.exists() else "# Benchmark results\n\nRows: `python -m benchmarks NAME`.\n"
    marker = f"## {section}\n"
    if marker not in text:
        table = "| " + " | ".join(header) + " |\n|" + "---|" * len(header) + "\n"
        text = text.rstrip("\n") + f"\n\n{marker}\n{table}"
    head, _, tail = text.partition(marker)
    # The section's table ends at the first blank line after it (or at the end of the file).
    body, sep, rest = tail.partition("\n\n")
    lines = body.rstrip("\n").split("\n")
    text = head + marker + "\n".join(lines + [row]) + "\n" + (sep[1:] + rest if sep else "")
    path.write_text(text)
    return row


def replace_section(section: str, body: str, path: Path | None = None) -> None:
    """Put `body` under `## section`, replacing what was there (for tables rewritten on every run)."""
    path = path or _target
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    marker = f"## {section}\n"
    head, found, tail = text.partition(marker)
    if found:
        # The section ends where the next one begins.
        nxt = tail.find("\n## ")
        rest = tail[nxt + 1 :] if nxt >= 0 else ""
        text = head + marker + "\n" + body.rstrip("\n") + "\n\n" + rest
    else:
        text = text.rstrip("\n") + f"\n\n{marker}\n{body.rstrip()}\n"
    path.write_text(text.rstrip("\n") + "\n")
