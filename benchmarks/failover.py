"""`python -m benchmarks failover`: how fast the trainer's tokens/s recovers after a peer is SIGKILLed.

A coordinator of the config (configs/tiny.toml: 2 stages), 2 peers per stage (`swarm peer
--coordinator URL --stage K --threads 1 --log-steps PATH`) and one trainer (`swarm train
--coordinator URL --steps N --inflight 4 --call-timeout T --log-json P`). Once every peer is
online, the trainer runs `--warmup-s` seconds (and at least `--window` + 1 steps); then the whole
process group of one peer of `--stage` (worker, DHT node, p2pd) gets SIGKILL, and the trainer
finishes its fixed number of steps on the 3 peers left.

Definitions (all times on the trainer's `elapsed_s` clock; the kill is placed on that clock by
polling its `--log-json` file: trainer start = min over lines of (time seen here - elapsed_s)):

- windowed tokens/s at step i = (tokens_i - tokens_{i-W}) / (elapsed_i - elapsed_{i-W}), W = `--window`
  steps (per-step timings on a small CPU machine are noisy);
- tokens/s before = median of the windows that start after `--warmup-s`/3 and end before the kill;
- tokens/s after (what the remaining capacity allows) = median of the windows that start at least
  `--settle-s` after the kill: the same swarm with 3 peers, measured in the same run;
- recovery s = (start of window c) - (kill), for the first window c that starts at or after the kill
  (all its steps ran after the kill) such that it and the next `--hold` - 1 windows are all
  >= `--threshold` x tokens/s after: the trainer has run at that rate since then. A window that
  straddles the kill would be carried by pre-kill steps (faster than the 3-peer swarm) and pass
  at once; measuring from the window's start, not its end, adds no window-length lag (a stall of
  S s right after the kill reads as about S s). Resolution: one step;
- dip = the lowest window that starts within `--settle-s` after the kill, / tokens/s after; for
  scale, the share of the steady-after windows themselves below the threshold (noise);
- microbatches lost (benchmarks/ledger.py) = training microbatches the trainer sent (the ids its
  records name) that no step in the `--log-steps` files of some stage applied, apart from those of
  the last steps, which may still sit in a live peer's accumulator when the run ends;
- applied twice = microbatch ids that more than one step of one stage applied;
- microbatches completed = the trainer's final `microbatches` count (of steps x accumulation).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import signal
import statistics
import time
from pathlib import Path

import httpx

from benchmarks import ledger
from benchmarks.common import (
    JsonTail,
    Proc,
    listed_names,
    log_dir,
    read_step_logs,
    serving,
    start_coordinator,
    start_peer,
    stop_all,
    survivors,
    wait_online,
    without_eval,
)
from benchmarks.results import append_row
from swarm.config import load_config

# The table before this one ("failover: 2 peers per stage, one killed ...") was measured while the
# replicas of a stage did not average and peers did not rebalance: another product. The one before
# that ("failover with averaging: ...") counted as lost the microbatches the trainer did not complete,
# which could not come out non-zero.
SECTION = (
    "failover with averaging: 2 x 2 swarm, one peer killed (SIGKILL of its process group); lost from the step logs"
)
ROOT = Path(__file__).resolve().parent.parent
AFTER_GOAL = 0.675  # steady tokens/s after the kill ÷ before: 0.9 x the 3/4 of the peers left


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="configs/tiny.toml", help="a 2-stage run config")
    # 160: at about 0.7 s a step (tiny.toml, 2 x 2 on 2 cores), 80 steps left no window that starts
    # 20 s after the kill, and the steady figure after it came out nan.
    p.add_argument("--steps", type=int, default=160, help="trainer steps (fixed, so its final counts are complete)")
    p.add_argument("--stage", type=int, default=1, help="stage of the peer to kill (default: the last, 1)")
    p.add_argument("--call-timeout", type=float, default=5.0, help="seconds before a call is retried elsewhere")
    p.add_argument("--inflight", type=int, default=4)
    p.add_argument("--warmup-s", type=float, default=35.0, help="trainer seconds before the kill")
    p.add_argument("--settle-s", type=float, default=20.0, help="steady-after windows start this long after the kill")
    p.add_argument("--window", type=int, default=5, help="steps per tokens/s window")
    p.add_argument("--hold", type=int, default=5, help="consecutive windows that must stay above the threshold")
    p.add_argument("--threshold", type=float, default=0.9, help="fraction of the steady tokens/s after the kill")
    p.add_argument("--timeout-s", type=float, default=600.0, help="give up when the trainer runs longer than this")
    p.add_argument("--no-rebalance", action="store_true", help="peers never move between stages (swarm peer flag)")
    p.add_argument("--allreduce-delay-s", type=float, default=0.2, help="with --during-allreduce: after the step")
    p.add_argument(
        "--during-allreduce",
        action="store_true",
        help="kill right after a step completes, while the stages average it (matchmaking lasts "
        "averaging.matchmaking_time_s), instead of at an arbitrary moment",
    )
    p.add_argument("--log-dir", default=None, help="where the logs go (default: a new /tmp/swarm-failover-* dir)")


# -- analysis ------------------------------------------------------------------------------------


def windows(records: list[dict], w: int) -> list[tuple[float, float, int, float]]:
    """(start elapsed, end elapsed, step, tokens/s) of every window of `w` consecutive steps."""
    out = []
    for i in range(w, len(records)):
        a, b = records[i - w], records[i]
        dt = b["elapsed_s"] - a["elapsed_s"]
        if dt > 0:
            out.append((a["elapsed_s"], b["elapsed_s"], b["step"], (b["tokens"] - a["tokens"]) / dt))
    return out


def recovery(wins: list, kill: float, target: float, hold: int) -> tuple[float | None, int | None]:
    """Seconds from the kill to the start of the first window (starting at or after the kill) that, with
    the next `hold` - 1 windows, stays >= target; and the step that window ends at. (None, None) if none."""
    after = [x for x in wins if x[0] >= kill]
    for c in range(len(after) - hold + 1):
        if all(x[3] >= target for x in after[c : c + hold]):
            return after[c][0] - kill, after[c][2]
    return None, None


def progress_notes(trainer_log: str) -> collections.Counter:
    """The trainer's status notes (tqdm descriptions), e.g. 'waiting for a peer of stage 1', with counts of
    progress-line redraws that showed them."""
    notes = collections.Counter()
    for chunk in re.split(r"[\r\n]", trainer_log):
        m = re.match(r"(waiting for a peer of stage \d+)", chunk.strip())
        if m:
            notes[m.group(1)] += 1
    return notes


# -- the benchmark -------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> str:
    cfg = load_config(args.config)
    if cfg.stages.count != 2:
        raise SystemExit(f"{args.config}: the failover benchmark expects a 2-stage config, not {cfg.stages.count}")
    if not 0 <= args.stage < cfg.stages.count:
        raise SystemExit(f"--stage {args.stage}: not a stage of {args.config}")
    acc = cfg.training.accumulation
    tmp = log_dir(args.log_dir, "failover")
    config, load_avg = without_eval(args.config, tmp, "failover")

    procs: list[Proc] = []
    peers: dict[str, Proc] = {}
    try:
        coordinator, url = start_coordinator(config, tmp / "coordinator.log")
        procs.append(coordinator)
        print(f"coordinator at {url}", flush=True)
        flags = ["--no-rebalance"] if args.no_rebalance else []
        for k in range(cfg.stages.count):
            for name in (f"a{k}", f"b{k}"):
                peers[name] = start_peer(url, name, k, tmp, "--log-steps", str(tmp / f"{name}.steps"), *flags)
                procs.append(peers[name])
        wait_online(url, peers)
        print(f"peers online: {', '.join(peers)}", flush=True)

        log_json = tmp / "train.jsonl"
        trainer = Proc(
            [
                "train",
                "--coordinator",
                url,
                "--steps",
                str(args.steps),
                "--inflight",
                str(args.inflight),
                "--call-timeout",
                str(args.call_timeout),
                "--log-json",
                str(log_json),
            ],
            tmp / "trainer.log",
        )
        procs.append(trainer)
        tail = JsonTail(log_json)
        started = time.monotonic()

        def check_trainer() -> None:
            if time.monotonic() - started > args.timeout_s:
                raise RuntimeError(f"the trainer ran past {args.timeout_s:.0f} s:\n{trainer.output()[-3000:]}")

        # Warm-up: until the trainer has run warmup_s seconds by its own clock, and at least one window
        # of steps (a loaded machine may take longer than warmup_s for that: no "before" without it).
        last_print = 0.0
        while True:
            tail.poll()
            t0 = tail.start()
            now = time.monotonic()
            if t0 is not None and now - t0 >= args.warmup_s and len(tail.records) > args.window:
                break
            if trainer.popen.poll() is not None:
                raise RuntimeError(f"the trainer exited during the warm-up:\n{trainer.output()[-3000:]}")
            check_trainer()
            if tail.records and now - last_print >= 5:
                last_print = now
                r = tail.records[-1]
                rate = r["tokens_per_s"]
                print(f"  warm-up: step {r['step']}, {r['elapsed_s']:.1f} s, {rate:,.0f} tokens/s", flush=True)
            time.sleep(0.05)

        if args.during_allreduce:
            # The stages begin averaging step s as soon as its last microbatch is through: right
            # when the trainer logs it. A fresh line, seen within the poll interval, is the moment.
            seen = len(tail.records)
            while len(tail.records) == seen:
                tail.poll()
                check_trainer()
                time.sleep(0.01)
            time.sleep(args.allreduce_delay_s)
        # The peer that serves --stage now: with rebalancing on, peers may have moved since they started.
        here = serving(url, args.stage)
        victim_name = f"b{args.stage}" if f"b{args.stage}" in here or not here else sorted(here)[0]
        victim = peers[victim_name]
        killed_at = time.monotonic()
        os.killpg(victim.popen.pid, signal.SIGKILL)
        steps_at_kill = len(tail.records)
        print(f"SIGKILL to peer {victim_name}'s process group at trainer step {steps_at_kill}", flush=True)
        left = survivors(victim.popen.pid, timeout=5)
        gone_s = None

        # After the kill: until the trainer finishes its steps.
        last_print = 0.0
        last_state = 0.0
        while trainer.popen.poll() is None:
            tail.poll()
            now = time.monotonic()
            if gone_s is None and now - last_state >= 0.5:
                last_state = now
                try:
                    if victim_name not in listed_names(url):
                        gone_s = now - killed_at
                        print(f"  {victim_name} gone from the coordinator's view after {gone_s:.1f} s", flush=True)
                except httpx.HTTPError:
                    pass
            if now - last_print >= 5 and tail.records:
                last_print = now
                r = tail.records[-1]
                wins = windows(tail.records[-(args.window + 1) :], args.window)
                rate = f"{wins[-1][3]:,.0f}" if wins else "-"
                print(
                    f"  +{now - killed_at:.0f} s: step {r['step']}, window tokens/s {rate}, "
                    f"calls retried {r.get('failures', 0)}",
                    flush=True,
                )
            check_trainer()
            time.sleep(0.05)
        tail.poll()
        rc = trainer.popen.returncode
        trainer_out = trainer.output()
        if rc != 0:
            raise RuntimeError(f"the trainer exited with {rc}:\n{trainer_out[-3000:]}")
        records = tail.records
        kill = killed_at - tail.start()  # the kill on the trainer's elapsed_s clock
        step_logs = read_step_logs({n: tmp / f"{n}.steps" for n in peers})
    finally:
        stop_all(procs)

    # -- numbers ---------------------------------------------------------------------------------
    w = args.window
    wins = windows(records, w)
    before_w = [x[3] for x in wins if x[0] >= args.warmup_s / 3 and x[1] <= kill]
    after_w = [x[3] for x in wins if x[0] >= kill + args.settle_s]
    before = statistics.median(before_w) if before_w else float("nan")
    after = statistics.median(after_w) if after_w else float("nan")
    rec_s, rec_step = recovery(wins, kill, args.threshold * after, args.hold) if after_w else (None, None)
    early = [x for x in wins if kill <= x[0] < kill + args.settle_s]
    dip = min(early, key=lambda x: x[3], default=None)
    noisy = sum(x < args.threshold * after for x in after_w) / len(after_w) if after_w else float("nan")
    retries = [
        b["elapsed_s"] - kill
        for a, b in zip(records[:-1], records[1:], strict=True)
        if b.get("failures", 0) > a.get("failures", 0)
    ]
    retry_at = ", ".join(f"+{t:.1f}" for t in retries[:8]) + (" ..." if len(retries) > 8 else "")
    pairs = zip(records[:-1], records[1:], strict=True)
    durations = [(b["elapsed_s"] - a["elapsed_s"], b["step"], b["elapsed_s"]) for a, b in pairs]
    before_kill = [d for d, _, end in durations if end <= kill]
    step_before = statistics.median(before_kill) if before_kill else float("nan")
    after_kill = [x for x in durations if x[2] > kill]
    longest = max(after_kill, default=(float("nan"), None, None))
    first_after = min((end for _, _, end in after_kill), default=float("nan")) - kill

    final = records[-1]
    retried = final.get("failures", 0)
    counted = ledger.count(records, step_logs, cfg.stages.count)
    victim_steps = [s for s in step_logs if s["peer"] == victim_name]
    victim_mbs = sum(len(s["microbatches"]) for s in victim_steps)
    notes = progress_notes(trainer_out)
    peer_logs = {n: (tmp / f"{n}.log").read_text() for n in peers if (tmp / f"{n}.log").exists()}
    moves = sum(text.count("moving from stage") for text in peer_logs.values())
    skipped = sum(len(re.findall(r"skipped step\(s\)", text)) for text in peer_logs.values())

    print("\nsummary", flush=True)
    rows = {
        "config": f"{args.config} (eval off), {args.steps} steps x {acc} microbatches, {args.inflight} in flight",
        "killed": f"{victim_name} (stage {args.stage}) at trainer {kill:.1f} s, after step {steps_at_kill - 1}",
        "processes left in its group": ", ".join(left) or "none",
        "gone from coordinator view": f"{gone_s:.1f} s after the kill" if gone_s is not None else "not seen",
        "call timeout": f"{args.call_timeout:g} s",
        f"tokens/s before (median of {len(before_w)} windows of {w} steps)": f"{before:,.0f}",
        f"tokens/s after, 3 peers (median of {len(after_w)} windows)": f"{after:,.0f} ({after / before:.2f} x before)",
        f"recovery to >= {args.threshold:.0%} of after": (
            f"{rec_s:.2f} s (window of steps {rec_step - w + 1}..{rec_step})" if rec_s is not None else "never"
        ),
        f"dip: lowest window in {args.settle_s:.0f} s after the kill": (
            f"{dip[3]:,.0f} = {dip[3] / after:.2f} x after, at +{dip[0] - kill:.1f}..+{dip[1] - kill:.1f} s"
            if dip
            else "-"
        ),
        f"steady-after windows below {args.threshold:.0%} (noise)": f"{noisy:.0%}",
        "steps with a retried call (s after the kill)": retry_at or "none",
        "first step completed after the kill": f"{first_after:.2f} s after it",
        "longest step after the kill": f"{longest[0]:.2f} s (step {longest[1]}); median before {step_before:.3f} s",
        "microbatches completed (trainer)": f"{final['microbatches']} of {args.steps * acc}",
        **counted.summary(),
        "calls retried": retried,
        f"{victim_name}'s optimizer steps before the kill": (
            f"{len(victim_steps)} ({victim_mbs} microbatches, applied only to its weights, which died with it)"
        ),
        "peers' moves between stages": moves,
        "stage steps skipped (gradients died)": skipped,
        "trainer status notes": ", ".join(f"{n} (x{c})" for n, c in notes.items()) or "none",
        "logs": str(tmp),
    }
    width = max(map(len, rows))
    print("\n".join(f"  {k:<{width}}  {v}" for k, v in rows.items()), flush=True)

    ratio = after / before if before > 0 else float("nan")
    goal = [
        "recovery met" if rec_s is not None and rec_s <= 5 else "recovery not met",
        "after met" if ratio >= AFTER_GOAL else "after not met",
        "lost met" if counted.lost == 0 else "lost not met",
    ]
    gone = f"{gone_s:.0f} s" if gone_s is not None else "-"
    mode = ("no rebalance" if args.no_rebalance else "rebalance on") + (
        f", during an all-reduce (+{args.allreduce_delay_s:g} s after a step)" if args.during_allreduce else ""
    )
    return append_row(
        SECTION,
        [
            "config",
            "mode",
            "killed",
            "steps",
            "call timeout s",
            "tokens/s before",
            "tokens/s after (steady, 3 peers)",
            "after ÷ before",
            f"recovery s (to >= {args.threshold:.0%} of steady after)",
            "dip (lowest window ÷ after)",
            "longest step after kill s",
            "moves",
            "microbatches completed (trainer)",
            "microbatches lost",
            "calls retried",
            "applied twice",
            "notes",
        ],
        [
            args.config,
            mode,
            f"stage {args.stage} peer at {kill:.1f} s",
            args.steps,
            f"{args.call_timeout:g}",
            f"{before:,.0f}",
            f"{after:,.0f}",
            f"{ratio:.2f}",
            f"{rec_s:.2f}" if rec_s is not None else "never",
            f"{dip[3] / after:.2f} at +{dip[0] - kill:.0f} s" if dip else "-",
            f"{longest[0]:.2f}",
            moves,
            f"{final['microbatches']} of {args.steps * acc}",
            f"{counted.lost} of {counted.sent}",
            retried,
            counted.applied_twice,
            f"goal recovery <= 5 s, after >= {AFTER_GOAL} x before (0.9 x 3/4 of the peers), lost 0: "
            f"{', '.join(goal)}; {skipped} stage step(s) skipped (their gradients died); "
            f"windows of {w} steps (per-step timing is noisy "
            f"here: {noisy:.0%} of the steady-after windows are themselves < {args.threshold:.0%} of their median); "
            f"before = median of windows in [{args.warmup_s / 3:.0f} s, kill], after = median of windows starting "
            f">= {args.settle_s:.0f} s after the kill; recovery = start of the first window wholly after the kill "
            f"from which {args.hold} windows in a row are >= {args.threshold:.0%} of after; median step before "
            f"{step_before:.3f} s; retries at {retry_at or '-'} s; "
            f"peer gone from the coordinator's view after {gone}; eval off; 1 torch thread per peer; "
            f"load avg {load_avg:.1f} at start",
        ],
    )
