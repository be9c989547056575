"""`python -m benchmarks data`: the streaming loader's tokens/s and memory on generated text files,
against the tokens/s the reference trainer consumes. Goals: RSS growth < 100 MB, loader >= 10x trainer.

The text (the embedded corpus, repeated) is written to a temporary folder and deleted after. The
loader streams one epoch of it in a child process (`python -m benchmarks.data FOLDER SEQ_LEN
MICRO_BATCH` prints its figures as JSON), so that its RSS is the loader's alone.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.local import tokens_per_s
from benchmarks.results import append_row
from swarm.config import load_config
from swarm.trainer.local import train_local

RSS_GOAL_MB = 100
RATIO_GOAL = 10


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gb", type=float, default=1.0, help="gigabytes of text to generate and stream")
    p.add_argument("--files", type=int, default=16)
    p.add_argument("--config", default="configs/small.toml", help="the trainer's config (its seq_len for both)")
    p.add_argument("--steps", type=int, default=5, help="reference trainer steps")
    p.add_argument("--warmup", type=int, default=1, help="trainer steps excluded from its tokens/s")


def write_corpus(folder: Path, size: int, files: int) -> None:
    """`files` text files of about size / files bytes each: the embedded corpus, repeated."""
    from swarm.config import DataConfig
    from swarm.sources import readers

    text = "\n\n".join(doc for _, read in readers(DataConfig()) for doc in read()).encode() + b"\n\n"
    for k in range(files):
        with open(folder / f"part-{k:03d}.txt", "wb") as f:
            for _ in range(size // files // len(text) + 1):
                f.write(text)


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def stream(path: str, seq_len: int, micro_batch: int) -> dict:
    """One epoch of the text files at `path` through TrainStream (each microbatch reported trained):
    tokens, seconds, and the growth of this process's RSS peak over its RSS after the first batch."""
    from swarm.config import DataConfig
    from swarm.data import ByteTokenizer, TrainStream

    data = TrainStream.local(DataConfig(source="files", path=path), seq_len, 0, ByteTokenizer())
    data.trained(data.next_microbatch(micro_batch))
    base = _kib("VmRSS")
    tokens, start = 0, time.perf_counter()
    while data.source.epoch == 0:
        batch = data.next_microbatch(micro_batch)
        data.trained(batch)
        tokens += batch.inputs.numel()
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "seconds": seconds, "rss_growth_mb": (_kib("VmHWM") - base) / 1024}


def measure(path: Path, seq_len: int, micro_batch: int) -> dict:
    """`stream` in a child process of its own."""
    args = [sys.executable, "-m", "benchmarks.data", str(path), str(seq_len), str(micro_batch)]
    done = subprocess.run(args, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def run(args: argparse.Namespace) -> str:
    cfg = load_config(args.config)
    folder = Path(tempfile.mkdtemp(prefix="swarm-data-bench-"))
    try:
        write_corpus(folder, int(args.gb * 1e9), args.files)
        size = sum(f.stat().st_size for f in folder.iterdir())
        loader = measure(folder, cfg.model.seq_len, cfg.training.micro_batch)
        records = train_local(cfg.with_data(str(folder)), args.steps)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    loader_tps = loader["tokens"] / loader["seconds"]
    trainer_tps = tokens_per_s(records, args.warmup)
    ratio = loader_tps / trainer_tps
    rss = loader["rss_growth_mb"]
    goals = (
        f"RSS growth < {RSS_GOAL_MB} MB: {'met' if rss < RSS_GOAL_MB else 'not met'}; "
        f"ratio >= {RATIO_GOAL}: {'met' if ratio >= RATIO_GOAL else 'not met'}"
    )
    return append_row(
        "data: streaming loader vs the reference trainer",
        ["text", "files", "seq_len", "loader tokens/s", "RSS growth", "trainer", "trainer tokens/s", "ratio", "goals"],
        [
            f"{size / 1e9:.2f} GB",
            args.files,
            cfg.model.seq_len,
            f"{loader_tps:,.0f}",
            f"{rss:.0f} MB",
            f"{args.config}, {args.steps} steps",
            f"{trainer_tps:,.0f}",
            f"{ratio:,.0f}",
            goals,
        ],
    )


if __name__ == "__main__":
    print(json.dumps(stream(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
