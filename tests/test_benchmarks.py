"""Every benchmark runs as the README says (`python -m benchmarks NAME`), at a tiny size.

Each runs in a fresh interpreter from the repository root, with rows sent to a file of the test's
(`--results`): benchmarks/results.md holds only real measurements and must not change. The sizes
are the smallest that still go through every phase of each benchmark (a kill, a restart, both
codecs of a comparison); what the rows say at this size is not checked, only that one is written.
A benchmark's smoke run is started by the first test about it and shared with the others, which
run on the same xdist worker (`about`); different benchmarks run on different workers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks.__main__ import BENCHMARKS
from benchmarks.averaging import SECTION as AVERAGING_SECTION
from benchmarks.common import averaging_spec, log_dir, spec_name
from benchmarks.net import unavailable
from benchmarks.pipeline import DELAYED_SECTION
from benchmarks.trainers import SECTION as TRAINERS_SECTION
from benchmarks.wire import TLS_SECTION
from swarm.children import ZYGOTE_ENV
from swarm.config import load_config
from swarm.zygote import zygote
from tests.conftest import ROOT

LOGS = ("--log-dir", "{tmp}/logs")  # the benchmarks that start processes keep their logs with the test
TINY = {
    "averaging": [
        *("--steps", "3", "--variants", "none/int8,none/int8/diloco3-pinned"),
        *("--every", "1", "--tail", "2", *LOGS),
    ],
    "chaos": [
        *("--stages", "2", "--per-stage", "2", "--steps", "6", "--no-baseline"),
        *("--kill-min-s", "5", "--kill-max-s", "6", "--coordinator-at", "2", "--coordinator-down-s", "2"),
        *("--freeze-at", "5", "--freeze-s", "2", "--timeout-s", "240", *LOGS),
    ],
    "coordinator": ["--stages", "2", "--peers", "10", "--requests", "5", "--timeout-s", "60", *LOGS],
    "dashboard": ["--stages", "2", "--peers", "10", "--warmup", "1", "--updates", "2", "--timeout-s", "60", *LOGS],
    "data": ["--gb", "0.002", "--files", "3", "--config", "configs/tiny.toml", "--steps", "2", "--warmup", "1"],
    "failover": ["--steps", "8", "--warmup-s", "1", "--settle-s", "1", "--window", "1", "--hold", "1", *LOGS],
    "fuzz": ["--cases", "10", *LOGS],
    "local": ["--config", "configs/tiny.toml", "--steps", "2", "--warmup", "1"],
    "outer": [
        *("--steps", "2", "--seeds", "2", "--variants", "int8/diloco2-lr1-m0,none/diloco2-lr0.7-m0.5"),
        *("--tail", "2", "--eval-batches", "2"),
    ],
    "pipeline": [
        *("--config", "configs/tiny.toml", "--steps", "2", "--warmup", "1", "--codecs", "none,int8"),
        "--delayed-updates",
    ],
    "scale": [
        *("--configs", "tiny", "--steps", "2", "--micro-batch", "2", "--global-batch", "4", "--inflight", "2", *LOGS)
    ],
    "rebalance": ["--delays", "0,0.05", "--start", "0,0", "--period", "1", "--hold", "1", "--timeout-s", "90", *LOGS],
    "simulate": ["--peers", "40", "--minutes", "4", "--policies", "swarm,static"],
    "trainers": [
        *("--steps", "6", "--warmup", "1", "--delays", "0.005,0.01", "--averaging", "int8/diloco3"),
        *("--timeout-s", "240", *LOGS),
    ],
    "verify": ["--steps", "3", "--repeat", "0", "--no-unchecked-liar", "--tail", "2", *LOGS],
    "wan": [
        *("--config", "configs/tiny.toml", "--mbit", "100", "--steps", "2", "--warmup", "0"),
        *("--compressions", "int8/diloco2", "--wire", "int8", "--inflight", "2", "--shipped"),
    ],
    "wire": [
        *("--config", "configs/tiny.toml", "--reps", "2", "--warmup", "1"),
        *("--codecs", "bf16", "--modules", "noop", "--batch", "2"),
    ],
}

# A smoke run takes seconds to a minute on 2 idle cores; on cores shared with the rest of the suite a
# test waits for its run up to this, and the minute an interrupted run has to stop.
SMOKE_TIMEOUT_S = 600
pytestmark = pytest.mark.timeout(SMOKE_TIMEOUT_S + 120)

# A row of any benchmark's table: "| date | machine | ...".
ROW_START = "| 20"
SHIPPED = ROOT / "benchmarks" / "results.md"


def cells(header: str, row: str) -> dict[str, str]:
    """A results table's row, by the names of its columns."""
    return dict(zip([c.strip() for c in header.split("|")], [c.strip() for c in row.split("|")], strict=True))


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass(frozen=True)
class Smoke:
    """A finished smoke run: the process, the results file it wrote its rows to, and whether
    benchmarks/results.md was the same after it as before."""

    done: subprocess.CompletedProcess
    results: Path
    shipped_unchanged: bool

    @property
    def logs(self) -> Path:
        return self.results.parent / "logs"

    def rows(self, section: str) -> list[str]:
        """The lines of `section`'s table (header and rule first), as the run wrote them."""
        _, found, text = self.results.read_text().partition(f"## {section}\n")
        assert found, f"no section {section!r} in {self.results}:\n{self.results.read_text()}"
        return [line for line in text.split("\n## ")[0].splitlines() if line.startswith("|")]


def smoke_run(name: str, tmp: Path) -> Smoke:
    results = tmp / "results.md"
    env = {k: v for k, v in os.environ.items() if k != "USE_LEGACY_BFLOAT16"}  # as a new shell has it
    env["PYTHONUNBUFFERED"] = "1"
    # One torch thread in every process it starts: a process training with torch's thread a core spins
    # on cores its swarm's other processes share (2 steps of tiny.toml: 168 s, 8.6 s with one).
    env["OMP_NUM_THREADS"] = "1"
    # Its `swarm` commands forked from a zygote (swarm/zygote.py), not each a new interpreter: about 3 s
    # of CPU each in imports, and the smoke runs start some two hundred. The zygote is lent by this
    # worker's, forked already imported: one of its own cost each run 6 s of CPU more.
    env[ZYGOTE_ENV] = "1"
    pipes, lent = zygote().lend(tmp)
    env.update(pipes)
    options = [arg.format(tmp=tmp) for arg in TINY[name]]
    args = [sys.executable, "-m", "benchmarks", "--results", str(results), name, *options]
    before = digest(SHIPPED)
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        out, err = proc.communicate(timeout=SMOKE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # Interrupted, a benchmark stops the processes it started (its finally blocks): each runs in a
        # process group of its own, and killed outright it left them running, a load on every later test.
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        err += f"\n(interrupted after {SMOKE_TIMEOUT_S} s)"
    finally:
        lent.send_signal(signal.SIGKILL)  # ended already if the run took it: it exits with its borrower
        lent.wait(30)
    done = subprocess.CompletedProcess(args, proc.returncode, out, err)
    return Smoke(done, results, digest(SHIPPED) == before)


_smoke_runs: dict[str, Smoke] = {}  # this worker process's, by benchmark


def smoke(name: str, tmp_path_factory: pytest.TempPathFactory) -> Smoke:
    """Benchmark `name`'s smoke run, started by the first test about it in this worker process and
    shared with the others (`about(name)` sends them all to one worker). It must have succeeded."""
    if name == "wan" and (why := unavailable()) is not None:
        pytest.skip(f"no emulated internet here: {why}")
    if name not in _smoke_runs:
        _smoke_runs[name] = smoke_run(name, tmp_path_factory.mktemp(name))
    run = _smoke_runs[name]
    assert run.done.returncode == 0, (
        f"python -m benchmarks {name} exited {run.done.returncode}:\n{run.done.stderr[-3000:]}"
    )
    return run


def about(name: str) -> pytest.MarkDecorator:
    """For the tests about one benchmark's smoke run: one xdist worker runs them all, so that they share
    the run, and the runs of different benchmarks go to different workers."""
    return pytest.mark.xdist_group(f"benchmark-{name}")


def test_every_benchmark_has_a_smoke_run():
    assert set(TINY) == set(BENCHMARKS)


@pytest.mark.parametrize("name", [pytest.param(name, marks=about(name)) for name in TINY])
def test_benchmark_runs_at_a_tiny_size_and_writes_a_row_elsewhere(processes, name, tmp_path_factory):
    run = smoke(name, tmp_path_factory)
    rows = [line for line in run.results.read_text().splitlines() if line.startswith(ROW_START)]
    assert rows, f"no row in {run.results}:\n{run.results.read_text()}"
    assert f"appended to {run.results}" in run.done.stdout
    assert run.shipped_unchanged, "the smoke run wrote to benchmarks/results.md"


@about("wire")
def test_wire_smoke_times_calls_over_mutual_tls_too(processes, tmp_path_factory):
    """The wire benchmark's TLS table gets its row at the tiny size too: the same worker answered over
    mutual TLS (run certificates both ways) and over plaintext, and both were timed."""
    run = smoke("wire", tmp_path_factory)
    assert "answered differently over TLS" not in run.done.stdout
    rows = [line for line in run.rows(TLS_SECTION) if line.startswith(ROW_START)]
    assert len(rows) == 1 and "| noop | bf16 |" in rows[0], run.results.read_text()


@about("wan")
def test_wan_smoke_sets_each_run_beside_the_config_as_shipped(processes, tmp_path_factory):
    """With --shipped, the wan benchmark first runs the config as it is (tiny.toml's own wire codec and
    averaging) and notes the other run's tokens/s as a multiple of it; the trainer's flags go to both runs."""
    run = smoke("wan", tmp_path_factory)
    header, _, *rows = [line for line in run.results.read_text().splitlines() if line.startswith("|")]
    shipped, diloco = (cells(header, row) for row in rows if "| all direct |" in row)  # then the relayed run
    tiny = load_config(ROOT / "configs" / "tiny.toml")
    own = f"wire {tiny.wire.codec}, averaging {tiny.averaging.mode}, {tiny.averaging.compression};"
    assert shipped["notes"].startswith(f"the config as shipped: {own}"), shipped
    assert diloco["notes"].startswith("wire int8, averaging int8/diloco2, "), diloco
    assert all(r["notes"].endswith("; trainer --inflight 2") for r in (shipped, diloco)), rows  # both runs took it
    multiple = float(re.search(r", ([0-9.]+)x the config as shipped in the same run;", diloco["notes"])[1])
    rates = float(diloco["tokens/s"]), float(shipped["tokens/s"])
    rounding = 0.005 + 0.5 / rates[1] + 0.5 * rates[0] / rates[1] ** 2  # 2 decimals; whole tokens/s in the rows
    assert multiple == pytest.approx(rates[0] / rates[1], abs=rounding), rows


@about("chaos")
def test_chaos_smoke_survives_killed_peers_a_dead_coordinator_and_a_frozen_peer(processes, tmp_path_factory):
    """configs/tiny.toml cut into 2 stages, 2 peers each, and a trainer: while it trains, the driver
    SIGKILLs the coordinator's process group and starts it again, freezes a peer's group with SIGSTOP
    and lets it go on, and SIGKILLs peers' groups and starts replacements. The run finishes every step
    with every microbatch done once as the trainer sees it, no gradient counted twice on any stage,
    calls retried elsewhere and a loss that went down; how many gradients died with the peers is
    reported, not asserted (a killed peer takes the gradients it held)."""
    run = smoke("chaos", tmp_path_factory)
    events = run.done.stdout[run.done.stdout.index("\nsummary\n") :]
    for event in ("SIGKILL to the coordinator", "coordinator started again", "SIGSTOP", "SIGCONT", "SIGKILL to peer"):
        assert event in events, f"no {event!r} among the events:\n{events}"
    header, _, row = [line for line in run.results.read_text().splitlines() if line.startswith("|")][-3:]
    row = cells(header, row)
    steps = int(row["steps"])
    logs = run.logs / "chaos"
    records = [json.loads(line) for line in (logs / "train.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(steps)), "the trainer did not finish every step"
    accumulation = load_config(logs / "run.toml").training.accumulation
    assert row["microbatches completed (trainer)"] == f"{steps * accumulation} of {steps * accumulation}", row
    assert row["applied twice"] == "0", row
    assert int(row["calls retried"]) > 0, row  # the dead and the frozen peers' calls went elsewhere
    assert int(row["peers killed + replaced"]) > 0, row
    assert records[-1]["loss"] < records[0]["loss"], [r["loss"] for r in records]


@about("averaging")
def test_averaging_smoke_counts_the_bytes_its_all_reduces_moved(processes, tmp_path_factory):
    """The averaging rows' bytes per parameter come from the peers' step logs: at the tiny size, with
    int8 averaging, 2 replicas per stage, about 1 byte a value each way (more than 0, less than 4)
    in a step that averaged; with DiLoCo in phases of 3 steps, one average in the 3 steps, its trainer's
    paths pinned as the variant names it (`-pinned`: the run config its peers joined says so)."""
    run = smoke("averaging", tmp_path_factory)
    header, _, *rows = run.rows(AVERAGING_SECTION)
    assert len(rows) == 2, run.results.read_text()
    every, diloco = (cells(header, row) for row in rows)
    assert every["averaging compression"] == diloco["averaging compression"] == "int8", rows
    assert (every["averaging mode"], diloco["averaging mode"]) == ("gradients", "diloco3-pinned"), rows
    joined = load_config(run.logs / "none-int8-diloco3-pinned" / "run.toml")
    averaging = joined.averaging
    assert (averaging.mode, averaging.inner_steps, averaging.paths) == ("diloco", 3, "pinned"), averaging
    # Both runs validate on the same 16 held-out batches; the DiLoCo run's last pass, after its 3rd
    # step (an outer step), on the outer weights, and the row checks the goal on both losses.
    assert joined.training.eval_batches == 16
    assert load_config(run.logs / "local.toml").training.eval_batches == 16
    assert "final model's held-out loss (outer weights)" in diloco["notes"], diloco
    assert "on 16 batches" in every["notes"] and "training loss" in every["notes"], every
    assert "outer_lr 1, outer momentum 0;" in diloco["notes"] and "outer_lr" not in every["notes"], rows
    per_step = float(every["averaging bytes / param / step"])
    assert 0.5 < per_step < 4, every
    # One int8 round in the 3 steps: about 2 bytes a value over 3 steps. (The gradients run may have
    # averaged alone in a step, so its figure is between one and three rounds' worth: beside two busy
    # loops it averaged once in its 3 steps, and both figures were 0.68.)
    assert 0 < float(diloco["averaging bytes / param / step"]) <= min(per_step, 1.0), (diloco, every)


@about("pipeline")
def test_pipeline_smoke_puts_delayed_updates_beside_the_synchronous_run(processes, tmp_path_factory):
    """With --delayed-updates each codec also trains with delayed updates, and a row of their own section
    gives both runs' efficiency and loss."""
    run = smoke("pipeline", tmp_path_factory)
    rows = [line for line in run.rows(DELAYED_SECTION) if line.startswith(ROW_START)]
    assert len(rows) == 2, run.results.read_text()
    assert all(float(row.split("|")[10]) > 0 and float(row.split("|")[12]) > 0 for row in rows), rows


@about("trainers")
def test_trainers_smoke_runs_its_swarm_with_the_averaging_it_names(processes, tmp_path_factory):
    """`--averaging int8/diloco3`: the coordinator's run config (the one the peers joined) averages with
    DiLoCo every 3 steps in int8, and the row says so."""
    run = smoke("trainers", tmp_path_factory)
    rows = [line for line in run.rows(TRAINERS_SECTION) if line.startswith(ROW_START)]
    assert len(rows) == 1 and "averaging int8/diloco3" in rows[0], run.results.read_text()
    averaging = load_config(run.logs / "run.toml").averaging
    assert (averaging.mode, averaging.inner_steps, averaging.compression) == ("diloco", 3, "int8"), averaging


@pytest.mark.parametrize(
    "name, settings",
    [
        ("int8", {"compression": "int8"}),
        ("powersgd2", {"compression": "powersgd", "rank": 2}),
        ("int8/diloco10", {"compression": "int8", "mode": "diloco", "inner_steps": 10}),
        (
            "none/diloco5-lr1-m0-pinned",
            {"compression": "none", "mode": "diloco", "inner_steps": 5, "outer_lr": 1.0, "outer_momentum": 0.0}
            | {"paths": "pinned"},
        ),
    ],
)
def test_an_averaging_variant_reads_as_its_settings_and_back(name, settings):
    assert averaging_spec(name) == settings
    assert spec_name(settings) == name


@pytest.mark.parametrize("name", ["zip", "int8/diloco0", "int8/pinned", "int8/diloco10-pinned-lr1", "int8/gossip"])
def test_a_malformed_averaging_variant_is_refused_with_the_form_it_takes(name):
    with pytest.raises(argparse.ArgumentTypeError, match=r"COMPRESSION/dilocoH\[-lrLR\]\[-mM\]\[-pinned\]"):
        averaging_spec(name)


def test_a_log_dir_with_an_earlier_runs_files_is_refused_and_left_as_it_was(tmp_path):
    """The peers append to the step logs they find: a benchmark run in a used folder counted the
    earlier run's steps too. A new or empty folder is taken; one with files is refused, untouched."""
    assert log_dir(str(tmp_path / "new"), "averaging") == tmp_path / "new"
    assert log_dir(str(tmp_path / "new"), "averaging") == tmp_path / "new"  # still empty
    (tmp_path / "new" / "p0a.steps").write_text('{"step": 1}\n')
    with pytest.raises(SystemExit, match="not empty"):
        log_dir(str(tmp_path / "new"), "averaging")
    assert (tmp_path / "new" / "p0a.steps").read_text() == '{"step": 1}\n'


def test_the_outer_benchmarks_reference_is_the_reference_trainers_update():
    """`python -m benchmarks outer` compares each variant with its own loop at one replica and no outer
    step: that loop must give the losses `swarm train --local` gives, or the ratios measure nothing."""
    from tqdm import tqdm

    from benchmarks.outer import train
    from swarm.trainer.local import train_local

    run = load_config(ROOT / "configs" / "tiny.toml").with_stages(1)
    records = train_local(run, 3)
    with tqdm(disable=True) as bar:
        final, _ = train(run, 3, 1, 3, 2, bar)
    assert final == pytest.approx(sum(r["loss"] for r in records) / 3, rel=1e-5)


@pytest.mark.parametrize("codec, tolerance", [("none", 1e-6), ("int8", 0.003), ("int4", 0.05)])
def test_the_outer_benchmarks_outer_step_at_lr_1_without_momentum_is_the_replicas_average(codec, tolerance):
    """`outer_step`: the pseudo-gradients averaged through the codec and the outer optimizer's step;
    at outer_lr 1 without momentum the outer weights land on the replicas' mean (within int8's
    rounding, half a step of a block's largest pseudo-gradient of 0.3: 0.3 / 127 / 2 twice; int4's,
    0.3 / 7 / 2 twice), and every replica takes them."""
    import torch

    from benchmarks.outer import outer_step
    from swarm.model import Stage
    from swarm.optim import make_outer_optimizer

    run = load_config(ROOT / "configs" / "tiny.toml").with_stages(1)
    outer_module, replicas = Stage(run, 0), [Stage(run, 0), Stage(run, 0)]
    start = [p.detach().clone() for p in outer_module.parameters()]
    with torch.no_grad():
        for m, shift in zip(replicas, (0.1, 0.3), strict=True):
            for p, s in zip(m.parameters(), start, strict=True):
                p.copy_(s - shift)
    assert (run.averaging.outer_lr, run.averaging.outer_momentum) == (1.0, 0.0)  # the defaults
    outer_step(outer_module, replicas, make_outer_optimizer(outer_module.parameters(), run), codec)
    for p, s in zip(outer_module.parameters(), start, strict=True):
        assert (p - (s - 0.2)).abs().max() <= tolerance
    for m in replicas:
        assert all(torch.equal(p, q) for p, q in zip(m.parameters(), outer_module.parameters(), strict=True))


@pytest.mark.parametrize("text", ["powersgd/diloco10", "int8", "int8/diloco10-pinned", ""])
def test_the_outer_benchmark_refuses_a_variant_it_cannot_run(text):
    from benchmarks.outer import variants

    with pytest.raises(argparse.ArgumentTypeError):
        variants(text)
