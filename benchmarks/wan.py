"""`python -m benchmarks wan`: a swarm on an emulated internet (benchmarks/net.py), at home bandwidths.

For each bandwidth in `--mbit`, a fresh emulated internet: a coordinator, 2 stages x 2 peers and a
trainer, each on a node of its own whose link carries that many Mbit/s each way (tc tbf; no added
latency: this kernel has no netem). The trainer runs `--steps` steps; tokens/s is taken over the
steps after `--warmup` (from the trainer's step log). Then, at `--relay-mbit`, the same swarm with
one peer of each stage behind a home router (no connection in), relayed through the coordinator:
relayed ÷ direct tokens/s at equal bandwidth (goal >= 0.8), and the seconds from a relayed peer's
start until it had served a microbatch (from the coordinator's state, read every 0.2 s). With
`--shipped`, the config as it is runs first at each bandwidth, and each other run's row notes its
tokens/s as a multiple of that (the side-by-side figure for "how much faster than the defaults").

Needs root, iproute2 and nftables (tests/install-tools.sh).
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import get_args

from benchmarks.common import averaging_spec, spec_name, with_averaging, with_wire
from benchmarks.net import Internet, NetSwarm, by_name, unavailable
from benchmarks.results import append_row
from swarm.config import Codec, load_config

SECTION = "wan: 2 stages x 2 peers on an emulated internet, every node at the same bandwidth"
PEERS = {"a0": 0, "b0": 0, "a1": 1, "b1": 1}
HOMES = {"b0", "b1"}  # behind home routers in the relayed run


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="configs/small.toml")
    p.add_argument("--mbit", default="1000,100,20", help="bandwidths, Mbit/s each way per node, comma-separated")
    p.add_argument(
        "--relay-mbit", type=float, default=100.0, help="bandwidth of the relayed vs direct comparison (0: none)"
    )
    p.add_argument(
        "--compressions",
        type=compressions,
        default="none",
        help="averaging of each run, comma-separated: COMPRESSION (every step) or COMPRESSION/dilocoH (DiLoCo, "
        "H inner steps); the relay comparison uses the first",
    )
    p.add_argument("--wire", choices=get_args(Codec), default=None, help="[wire] codec (default: the config's)")
    p.add_argument(
        "--shipped",
        action="store_true",
        help="first run the config as it is (its own wire codec and averaging) at each bandwidth, and note each "
        "other run's tokens/s as a multiple of it",
    )
    p.add_argument("--steps", type=int, default=8)
    p.add_argument(
        "--inflight", type=int, default=None, help="the trainer's microbatches in flight, every run (default: its own)"
    )
    p.add_argument(
        "--delayed-updates", action="store_true", help="the trainer's --delayed-updates, every run (spot checks off)"
    )
    p.add_argument("--warmup", type=int, default=2, help="steps excluded from tokens/s")
    p.add_argument("--timeout-s", type=float, default=900.0, help="per run")


def tokens_per_s(steps: list[dict], warmup: int, config) -> float:
    """Tokens/s over the steps after `warmup` (elapsed_s is the trainer's clock at each step's end)."""
    done = steps[warmup:]
    if len(done) < 2:
        raise SystemExit(f"wan: only {len(steps)} steps logged; raise --steps above --warmup + 1")
    seconds = done[-1]["elapsed_s"] - steps[warmup - 1]["elapsed_s"] if warmup else done[-1]["elapsed_s"]
    return len(done) * config.training.global_batch * config.model.seq_len / seconds


def trainer_flags(args: argparse.Namespace) -> list[str]:
    """The `swarm train` flags that every run of this benchmark passes."""
    flags = ["--inflight", str(args.inflight)] if args.inflight else []
    return flags + (["--delayed-updates", "--verify-fraction", "0"] if args.delayed_updates else [])


def one_run(
    config_path: Path, mbit: float, homes: set[str], steps: int, timeout: float, flags: Sequence[str] = ()
) -> tuple[list[dict], float]:
    """A run at `mbit`; its step log and the seconds until every peer in `homes` served (0: no homes;
    nan: one had served nothing when the trainer ended)."""
    with Internet() as net, tempfile.TemporaryDirectory(prefix="swarm-wan-") as tmp:
        names = ("coordinator", "trainer", *PEERS)
        nodes = {n: {"up_mbit": mbit, "down_mbit": mbit, "home": n in homes} for n in names}
        swarm = NetSwarm(net, Path(tmp), config_path, nodes)
        try:
            swarm.coordinator()
            started = time.monotonic()
            for name, stage in PEERS.items():
                swarm.peer(name, stage)
            swarm.state(
                lambda s: len(by_name(s, "state")) == 4 and set(by_name(s, "state").values()) == {"online"}, 300
            )
            if homes:
                swarm.state(lambda s: all(by_name(s, "reach").get(n) == "relayed" for n in homes), 120)
            swarm.train(steps, *flags, wait=False)
            trainer = swarm.procs[-1]
            first_served = 0.0
            if homes:

                def served(s: dict) -> bool:
                    return all(by_name(s, "samples_served").get(n, 0) > 0 for n in homes)

                # A short run can end before the trainer routed anything to a relayed peer: then nan.
                state = swarm.state(lambda s: served(s) or trainer.popen.poll() is not None, timeout)
                first_served = time.monotonic() - started if served(state) else math.nan
            if trainer.popen.wait(timeout) != 0:
                raise SystemExit(f"wan: the trainer failed at {mbit} Mbit/s: {trainer.output()[-2000:]}")
            return swarm.steps(), first_served
        finally:
            swarm.close()


COLUMNS = ["config", "Mbit/s per node", "peers", "steps", "tokens/s", "relayed ÷ direct", "s to first relayed", "notes"]
NOTE = "no added latency (no netem); tokens/s after the warm-up steps"


def run_note(args: argparse.Namespace) -> str:
    """What every row of a run notes: the emulation, and the trainer's flags when set."""
    flags = trainer_flags(args)
    return NOTE + (f"; trainer {' '.join(flags)}" if flags else "")


def compressions(text: str) -> list[str]:
    chosen = [spec_name(averaging_spec(c)) for c in text.split(",") if c.strip()]
    if not chosen:
        raise argparse.ArgumentTypeError(f"{text!r}: no averaging given")
    return chosen


def run(args: argparse.Namespace) -> str:
    if (why := unavailable()) is not None:
        raise SystemExit(f"wan: no emulated internet here: {why}")
    config = load_config(args.config)
    rates: dict[tuple[str, float], float] = {}
    rows = []
    with tempfile.TemporaryDirectory(prefix="swarm-wan-configs-") as tmp:

        def measure(compression: str | None, mbit: float, homes: set[str]) -> tuple[float, float]:
            """Tokens/s and seconds to first relayed; `compression` None: the config as it is."""
            path = Path(tmp) / f"{(compression or 'shipped').replace('/', '-')}.toml"
            text = Path(args.config).read_text()
            if compression is not None:
                text = with_wire(text, args.wire) if args.wire else text
                text = with_averaging(text, averaging_spec(compression))
            path.write_text(text)
            steps, first = one_run(path, mbit, homes, args.steps, args.timeout_s, trainer_flags(args))
            return tokens_per_s(steps, args.warmup, config), first

        bandwidths = [float(x) for x in args.mbit.split(",")]
        shipped: dict[float, float] = {}
        if args.shipped:
            what = f"{config.averaging.mode}, {config.averaging.compression}"
            for mbit in bandwidths:
                rate = shipped[mbit] = measure(None, mbit, set())[0]
                print(f"{mbit:g} Mbit/s, the config as shipped, direct: {rate:,.0f} tokens/s", flush=True)
                note = f"the config as shipped: wire {config.wire.codec}, averaging {what}; {run_note(args)}"
                values = [args.config, f"{mbit:g}", "all direct", args.steps, f"{rate:.0f}", "", "", note]
                rows.append(append_row(SECTION, COLUMNS, values))
        for compression in args.compressions:
            for mbit in bandwidths:
                rate = rates[compression, mbit] = measure(compression, mbit, set())[0]
                versus = f", {rate / shipped[mbit]:.2f}x the config as shipped in the same run" if shipped else ""
                print(f"{mbit:g} Mbit/s, averaging {compression}, direct: {rate:,.0f} tokens/s{versus}", flush=True)
                note = f"wire {args.wire or config.wire.codec}, averaging {compression}{versus}; {run_note(args)}"
                values = [args.config, f"{mbit:g}", "all direct", args.steps, f"{rate:.0f}", "", "", note]
                rows.append(append_row(SECTION, COLUMNS, values))
        mbit, compression = args.relay_mbit, args.compressions[0]
        if mbit <= 0:
            return "\n".join(rows)
        if (compression, mbit) not in rates:
            rates[compression, mbit] = measure(compression, mbit, set())[0]
        relayed, first = measure(compression, mbit, HOMES)
    ratio = relayed / rates[compression, mbit]
    print(f"{mbit:g} Mbit/s, {', '.join(sorted(HOMES))} relayed: {relayed:,.0f} tokens/s, {ratio:.2f} of direct; "
          f"they served their first microbatch {first:.1f} s after they started", flush=True)  # fmt: skip
    verdict = "met" if ratio >= 0.8 else "NOT met"
    note = (
        f"goal relayed ÷ direct >= 0.8: {verdict}; b0, b1 behind home routers, relayed by the coordinator; "
        f"averaging compression {compression}; {run_note(args)}"
    )
    values = [args.config, f"{mbit:g}", "b0, b1 relayed", args.steps, f"{relayed:.0f}", f"{ratio:.2f}", f"{first:.1f}"]
    rows.append(append_row(SECTION, COLUMNS, [*values, note]))
    return "\n".join(rows)
