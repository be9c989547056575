"""`python -m benchmarks simulate`: the swarm at internet scale, simulated (benchmarks/swarmsim.py).

For each size in `--peers` and each policy in `--policies`, one simulation of `--minutes` with churn
(exponential sessions of mean `--session-min`, joins that keep the population, `--mass-leave` of the
peers leaving at once at `--mass-leave-at-min`), over a device mix of T4, 3090, 4090, A100 and
CPU-class stragglers on home links. Policies: `swarm` (this project's: swarm/rebalance.py with its
steadiness and randomised periods), `petals` (a peer moves to the stage that raises the minimum
most, checked every 60 s, when balance quality is below 0.75), `static` (one best plan at the start,
DT-FM-style; joiners placed by swarm/placement.py, nobody moves), and `clairvoyant`, a ceiling and
not a design (each departure seen at once and answered by a move that keeps serving while it
downloads: what is lost under it, any policy that downloads a stage before serving it loses).

Per run, one row: achieved throughput ÷ oracle averaged over time; seconds after the mass departure
until the ratio is back to `--goal` (inf: never); moves per peer-hour; share of microbatches with a
failed hop (retried); DHT messages per node per second; wall seconds. Peers announce as their
capacity the lower of their device's benchmark and their link's speed test, as real peers do
(peer/throughput.py `capacity`); with `--compute-only-capacity`, the benchmark alone. The mass
departure takes its peers from the first `--mass-leave-stages` stages (an outage that hits some
stages, so that recovering needs peers to move), and departed peers' records stay in the DHT until
they expire, as a killed peer's do. `--settle` and `--no-ready-at` measure the swarm policy without
what this version changed: a view that must hold still longer before a peer acts on it, and movers
that do not say when they will serve their target. Beside the results, the plot
simulate_ratio.svg: the ratio over simulated time for the largest size, one line per policy.
"""

from __future__ import annotations

import argparse
import hashlib
import time

from tqdm import tqdm

from benchmarks.plot import line_chart
from benchmarks.results import append_row, target
from benchmarks.swarmsim import SimOptions, Simulation
from swarm import rebalance
from swarm.config import RebalanceConfig
from swarm.rebalance import SETTLE_S

# (The rows of the section without "policy version and capacity" in its name have two columns more
# than its header from the rows that named the policy's version on: new rows go to this one.)
SECTION = "simulate: 8 stages, churn and a mass departure, achieved throughput ÷ oracle; policy version and capacity"
PLOT_NAME = "simulate_ratio.svg"
POLICIES = ("swarm", "petals", "static", "clairvoyant")


def positive_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 2:
        raise argparse.ArgumentTypeError(f"every size must be at least 2 peers, got {text!r}")
    return values


def policies(text: str) -> list[str]:
    names = text.split(",")
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown policy {', '.join(unknown)}: choose from {', '.join(POLICIES)}")
    return names


def positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peers", type=positive_ints, default=[100, 1000], help="swarm sizes, comma-separated")
    p.add_argument("--stages", type=int, default=8, choices=range(1, 65), metavar="[1-64]")
    p.add_argument("--minutes", type=positive, default=120.0, help="simulated minutes")
    p.add_argument("--policies", type=policies, default=list(POLICIES), help=",".join(POLICIES))
    p.add_argument("--session-min", type=positive, default=60.0, help="mean session length, minutes")
    p.add_argument("--mass-leave", type=fraction, default=0.2, help="fraction leaving at once (0: none)")
    p.add_argument("--mass-leave-at-min", type=positive, default=None, help="when (default: half-way)")
    p.add_argument(
        "--period", type=positive, default=RebalanceConfig().period_s, help="rebalance.period_s of the swarm policy"
    )
    p.add_argument(
        "--margin", type=positive, default=RebalanceConfig().margin, help="rebalance.margin of the swarm policy"
    )
    p.add_argument(
        "--settle", type=positive, default=SETTLE_S, help="seconds a view must hold still before a swarm peer acts"
    )
    p.add_argument(
        "--no-ready-at",
        action="store_true",
        help="movers do not announce when they will serve their target (the trainer waits for their new record)",
    )
    p.add_argument("--goal", type=float, default=0.9, help="ratio that counts as recovered")
    p.add_argument(
        "--mass-leave-stages",
        type=int,
        default=2,
        metavar="N",
        help="the peers that leave at once all come from the first N stages (0: from every stage)",
    )
    p.add_argument(
        "--compute-only-capacity",
        action="store_true",
        help="peers announce their device's benchmark alone as their capacity (as before the link counted)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plot", action="store_true", help="do not write simulate_ratio.svg")


def simulate(options: SimOptions, goal: float) -> tuple[Simulation, float]:
    """Run one simulation with a progress bar; the simulation and its wall seconds."""
    sim = Simulation(options)
    began = time.monotonic()
    sim.start()
    steps = int(options.minutes * 60 / 4.0)
    with tqdm(range(steps), desc=f"{options.policy} {options.peers} peers", unit="step", leave=False) as bar:
        for _ in bar:
            sim.step()
            if len(sim.result.achieved) % 50 == 0:
                bar.set_postfix(peers=len(sim.peers), ratio=f"{sim.result.ratio:.3f}", moves=sim.result.moves)
    sim.result.recovery_s = sim.recovery(goal)
    return sim, time.monotonic() - began


def _policy_version() -> str:
    """The first 8 hex digits of the SHA-256 of swarm/rebalance.py as imported: which version of the
    policy the rows measured (read once, at import, so that a later edit of the file does not relabel them)."""
    with open(rebalance.__file__, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:8]


POLICY_VERSION = _policy_version()


def policy_cell(policy: str, args: argparse.Namespace) -> str:
    """The policy as a row names it: the swarm policy with its settings, and whether movers announce
    when they will serve their target (every policy but Petals-style moves with make-before-break)."""
    settings = [f"margin {args.margin:g}", f"period {args.period:g} s", f"settle {args.settle:g} s"]
    if policy != "swarm":
        settings = []
    if args.no_ready_at and policy in ("swarm", "clairvoyant"):
        settings.append("movers' ready time not announced")
    return f"{policy} ({', '.join(settings)})" if settings else policy


def mass_leave(args: argparse.Namespace, at: float) -> str:
    if args.mass_leave <= 0:
        return "none"
    where = f"from stages 0-{args.mass_leave_stages - 1}" if args.mass_leave_stages else "from all stages"
    return f"{args.mass_leave:g} at {at:g} min {where}"


def run(args: argparse.Namespace) -> str:
    if not 0 <= args.mass_leave_stages <= args.stages:
        raise SystemExit(f"--mass-leave-stages {args.mass_leave_stages} is not within 0..{args.stages} (--stages)")
    at = args.mass_leave_at_min if args.mass_leave_at_min is not None else args.minutes / 2
    if at >= args.minutes:
        raise SystemExit(f"--mass-leave-at-min {at:g} is not within the {args.minutes:g} simulated minutes")
    row, curves = "", {}
    for n in args.peers:
        for policy in args.policies:
            options = SimOptions(
                peers=n,
                stages=args.stages,
                minutes=args.minutes,
                session_min=args.session_min,
                mass_leave_at_min=at if args.mass_leave > 0 else None,
                mass_leave_fraction=args.mass_leave,
                policy=policy,
                period_s=args.period,
                margin=args.margin,
                settle_s=args.settle,
                announce_ready=not args.no_ready_at,
                seed=args.seed,
                mass_leave_stages=args.mass_leave_stages,
                link_in_capacity=not args.compute_only_capacity,
            )
            sim, wall = simulate(options, args.goal)
            res = sim.result
            recovery = "n/a" if res.recovery_s is None else f"{res.recovery_s:.0f}"
            moves_per_peer_hour = res.moves / (res.peer_seconds / 3600)
            retried = res.retried / res.microbatches if res.microbatches else 0.0
            dht = res.dht_messages / res.node_seconds
            print(
                f"{policy} {n} peers: ratio {res.ratio:.3f}, recovery {recovery} s, "
                f"{moves_per_peer_hour:.2f} moves/peer-hour, retried {retried:.4f}, "
                f"DHT {dht:.1f} msg/node/s, wall {wall:.1f} s",
                flush=True,
            )
            if n == max(args.peers):
                curves[policy] = [(t / 60, r) for t, r in res.ratio_series()]
            row = append_row(
                SECTION,
                [
                    "peers",
                    "stages",
                    "policy",
                    "rebalance.py sha256",
                    "capacity announced",
                    "minutes",
                    "session min",
                    "mass leave",
                    "achieved ÷ oracle",
                    f"recovery s (to {args.goal:g})",
                    "moves/peer-hour",
                    "retried share",
                    "DHT msg/node/s",
                    "wall s",
                ],
                [
                    n,
                    args.stages,
                    policy_cell(policy, args),
                    POLICY_VERSION,
                    "compute" if args.compute_only_capacity else "compute and link",
                    f"{args.minutes:g}",
                    f"{args.session_min:g}",
                    mass_leave(args, at),
                    f"{res.ratio:.3f}",
                    recovery,
                    f"{moves_per_peer_hour:.2f}",
                    f"{retried:.4f}",
                    f"{dht:.1f}",
                    f"{wall:.1f}",
                ],
            )
    if not args.no_plot:
        plot = target().parent / PLOT_NAME
        plot.write_text(
            line_chart(
                curves,
                f"{max(args.peers)} peers, {args.stages} stages: achieved throughput ÷ oracle",
                "simulated minutes",
                "achieved ÷ oracle",
            )
        )
        print(f"plot: {plot}", flush=True)
    return row
