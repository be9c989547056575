"""What a training run shows and records: a progress bar, `--log-json` lines and a final summary.

Both trainers (local and over the network) report through `RunLog`, so the JSON contract
`{"step", "loss", "val_loss", "tokens", "tokens_per_s", "elapsed_s"}` has one implementation.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TextIO

from tqdm import tqdm


def eval_due(step: int, steps: int, every: int) -> bool:
    """Validation runs every `every` steps and after the last one (never when `every` is 0)."""
    return every > 0 and ((step + 1) % every == 0 or step == steps - 1)


class RunLog:
    def __init__(
        self,
        steps: int,
        log_json: str | Path | None = None,
        desc: str = "train",
        out: TextIO | None = None,
        log_windows: str | Path | None = None,
    ):
        """`log_windows`: one JSON line per trained microbatch to this file, naming its windows (`trained`)."""
        self.out = out or sys.stderr
        self.bar = tqdm(total=steps, desc=desc, unit="step", file=self.out, dynamic_ncols=True)
        self.json = open(log_json, "w") if log_json else None  # noqa: SIM115 (closed in close())
        self.windows = open(log_windows, "w") if log_windows else None  # noqa: SIM115 (closed in close())
        self.start = time.perf_counter()
        self.tokens = 0
        self.records: list[dict] = []

    def step(self, step: int, loss: float, tokens: int, val_loss: float | None = None, **extra) -> dict:
        self.tokens += tokens
        elapsed = time.perf_counter() - self.start
        record = {
            "step": step,
            "loss": round(loss, 6),
            "tokens": self.tokens,
            "tokens_per_s": round(self.tokens / elapsed, 2) if elapsed > 0 else 0.0,
            "elapsed_s": round(elapsed, 3),
        }
        if val_loss is not None:
            record["val_loss"] = round(val_loss, 6)
        record.update(extra)
        self.records.append(record)
        if self.json:
            self.json.write(json.dumps(record) + "\n")
            self.json.flush()
        postfix = {"loss": f"{loss:.3f}", "tok/s": f"{record['tokens_per_s']:.0f}"}
        if val_loss is not None:
            postfix["val"] = f"{val_loss:.3f}"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)
        return record

    def trained(self, step: int, ids: tuple[tuple[int, int], ...]) -> None:
        """A microbatch of step `step` is trained: its windows, (shard index, window index) each."""
        if self.windows:
            self.windows.write(json.dumps({"step": step, "ids": ids}) + "\n")
            self.windows.flush()

    def note(self, text: str) -> None:
        """A status line next to the bar (e.g. 'waiting for stage 1')."""
        self.bar.set_description_str(text)

    def close(self, **facts) -> str:
        """Close the bar and the JSON file; print and return the summary."""
        self.bar.close()
        for f in (self.json, self.windows):
            if f:
                f.close()
        last = self.records[-1] if self.records else {}
        vals = [r["val_loss"] for r in self.records if "val_loss" in r]
        rows = {
            "steps": len(self.records),
            "final loss": f"{last['loss']:.4f}" if last else "-",
            "final val loss": f"{vals[-1]:.4f}" if vals else "-",
            "tokens": f"{self.tokens:,}",
            "elapsed": f"{time.perf_counter() - self.start:.1f} s",
            "tokens/s": f"{last.get('tokens_per_s', 0):,.0f}",
            **facts,
        }
        width = max(map(len, rows))
        summary = "\n".join(["summary"] + [f"  {k:<{width}}  {v}" for k, v in rows.items()])
        print(summary, file=sys.stdout, flush=True)
        return summary
