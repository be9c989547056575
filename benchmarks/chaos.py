"""`python -m benchmarks chaos`: training goes on while peers die, the coordinator dies and a peer freezes.

A swarm of the config (configs/tiny.toml) cut into `--stages` stages, `--per-stage` peers each
(`swarm peer --coordinator URL --stage K --no-rebalance --log-steps PATH`), and one trainer
(`swarm train --coordinator URL --steps N --call-timeout T --log-json P`). While the trainer runs,
a chaos driver, on the trainer's clock:

- every U(`--kill-min-s`, `--kill-max-s`) seconds SIGKILLs the process group of a random peer (its
  worker, DHT node and p2pd) and starts a replacement on the same stage. It never takes the last
  working peer of a stage: the victim's stage keeps at least one peer that is online and not frozen;
- at `--coordinator-at` s SIGKILLs the coordinator's group and starts it again `--coordinator-down-s`
  later, with the same state directory, HTTP port and DHT port (a replacement due meanwhile keeps
  trying the coordinator until it is back: `swarm peer --join-wait`);
- at `--freeze-at` s stops a random peer's whole group with SIGSTOP, and after `--freeze-s` s lets it
  go on with SIGCONT (a machine that hangs, or drops off the network, and comes back).

Then the same swarm trains the same number of steps undisturbed, for comparison (`--no-baseline`:
skip it).

What is measured (benchmarks/ledger.py, from the ids the trainer's records name and the peers'
step logs, the killed ones' included):
- microbatches lost = training microbatches the trainer sent whose gradient no optimizer step of
  some stage applied, apart from the last steps', which may still sit in a live peer's accumulator
  at the end. A killed peer takes the gradients it accumulated since its stage's last step with it;
  a frozen peer misses its stage's steps and drops what it held when it comes back;
- applied twice = microbatches that more than one optimizer step of one stage applied: a microbatch
  whose gradient was counted twice;
- microbatches completed (trainer): every microbatch's forward and backward came back, as the
  trainer sees it;
- final loss: the validation loss after the last step (the same validation batches in both runs)
  and the mean training loss of the last 10 steps; chaos ÷ undisturbed. Goal: within 5%.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import ledger
from benchmarks.common import JsonTail, Proc, final_loss, last_val, log_dir, read_step_logs, stop_all
from benchmarks.results import append_row
from swarm.children import coordinator
from swarm.config import RunConfig, dump_config, load_config
from swarm.net import free_port
from swarm.ready import CoordinatorReady, wait_ready

# The table before this one (the same title without "lost from the step logs") counted as lost the
# microbatches the trainer did not complete, which could not come out non-zero: another measurement.
SECTION = (
    "chaos: peers SIGKILLed and replaced, the coordinator killed and restarted, a peer frozen (SIGSTOP); "
    "lost from the step logs"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="configs/tiny.toml")
    p.add_argument("--stages", type=int, default=3, help="stages to cut the model into (default 3)")
    p.add_argument("--per-stage", type=int, default=2, help="peers per stage (default 2)")
    p.add_argument(
        "--steps", type=int, default=80, help="trainer steps of each run (default 80: 5 to 6 min on 2 cores)"
    )
    p.add_argument("--kill-min-s", type=float, default=20.0)
    p.add_argument("--kill-max-s", type=float, default=40.0)
    p.add_argument("--coordinator-at", type=float, default=90.0, help="trainer second of the coordinator's kill")
    p.add_argument("--coordinator-down-s", type=float, default=10.0)
    p.add_argument("--freeze-at", type=float, default=150.0, help="trainer second a peer is frozen")
    p.add_argument("--freeze-s", type=float, default=30.0)
    p.add_argument("--call-timeout", type=float, default=5.0, help="seconds before a call is retried elsewhere")
    p.add_argument("--inflight", type=int, default=4)
    p.add_argument("--seed", type=int, default=0, help="of the driver's random choices")
    p.add_argument("--timeout-s", type=float, default=1500.0, help="give up on a run that takes longer")
    p.add_argument("--no-baseline", action="store_true", help="skip the undisturbed run")
    p.add_argument("--log-dir", default=None, help="where the logs go (default: a new /tmp/swarm-chaos-* dir)")


@dataclass
class Plan:
    steps: int
    stages: int = 3
    per_stage: int = 2
    chaos: bool = True
    kill_every: tuple[float, float] = (20.0, 40.0)
    coordinator_at: float = 90.0
    coordinator_down_s: float = 10.0
    freeze_at: float = 150.0
    freeze_s: float = 30.0
    call_timeout: float = 5.0
    inflight: int = 4
    seed: int = 0
    timeout_s: float = 1500.0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Plan:
        return cls(
            steps=args.steps,
            stages=args.stages,
            per_stage=args.per_stage,
            kill_every=(args.kill_min_s, args.kill_max_s),
            coordinator_at=args.coordinator_at,
            coordinator_down_s=args.coordinator_down_s,
            freeze_at=args.freeze_at,
            freeze_s=args.freeze_s,
            call_timeout=args.call_timeout,
            inflight=args.inflight,
            seed=args.seed,
            timeout_s=args.timeout_s,
        )


@dataclass
class Outcome:
    """What one run did and what its logs say."""

    steps: int
    accumulation: int
    records: list[dict]  # the trainer's --log-json lines
    step_logs: list[dict]  # every optimizer step of every peer, with the microbatches it applied
    events: list[tuple[float, str]] = field(default_factory=list)  # (trainer second, what the driver did)
    duration_s: float = 0.0

    @property
    def microbatches(self) -> int:
        """Microbatches completed, as the trainer counts them."""
        return self.records[-1]["microbatches"] if self.records else 0

    def ledger(self, stages: int) -> ledger.Ledger:
        return ledger.count(self.records, self.step_logs, stages)

    @property
    def final_val(self) -> float | None:
        return last_val(self.records)

    @property
    def final_train(self) -> float:
        return final_loss(self.records, 10)

    @property
    def retried(self) -> int:
        return self.records[-1].get("failures", 0) if self.records else 0

    def longest_step(self) -> tuple[float, int]:
        pairs = zip(self.records[:-1], self.records[1:], strict=False)
        return max(((b["elapsed_s"] - a["elapsed_s"], b["step"]) for a, b in pairs), default=(0.0, 0))


class ChaosSwarm:
    """A coordinator (restartable: fixed ports and state directory), peers and one trainer."""

    def __init__(self, run: RunConfig, plan: Plan, tmp: Path):
        self.run, self.plan, self.tmp = run, plan, tmp
        tmp.mkdir(parents=True, exist_ok=True)
        self.config = tmp / "run.toml"
        self.config.write_text(dump_config(run))
        self.port, self.dht_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: list[Proc] = []
        self.coordinator: Proc | None = None
        self.peers: dict[str, tuple[int, Proc]] = {}  # name -> (stage, process); killed ones are dropped
        self.frozen: str | None = None
        self.trainer: Proc | None = None
        self.replacements = 0

    def start_coordinator(self, wait: bool = True) -> None:
        n = sum(1 for p in self.procs if p.args[0] == "coordinator")
        # The same ports and state folder at every start: a restarted coordinator is found where it was.
        fixed = ["--dht-port", str(self.dht_port), "--state-dir", str(self.tmp / "coordinator.state")]
        self.coordinator = coordinator(self.config, self.tmp / f"coordinator-{n}.log", *fixed, port=self.port)
        self.procs.append(self.coordinator)
        if wait:
            wait_ready(self.coordinator, CoordinatorReady, timeout=60)

    def start_peer(self, name: str, stage: int) -> None:
        args = ["peer", "--coordinator", self.url, "--stage", str(stage), "--public-name", name, "--threads", "1"]
        args += ["--checkpoint-dir", "none", "--no-rebalance", "--log-steps", str(self.tmp / f"{name}.steps")]
        proc = Proc(args, self.tmp / f"{name}.log", ready=True)
        self.procs.append(proc)
        self.peers[name] = (stage, proc)

    def online(self, name: str) -> bool:
        """Whether the peer has served its stage (it wrote its ready file)."""
        return self.peers[name][1].ready_file.exists()

    def wait_online(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while not all(self.online(n) for n in self.peers):
            dead = [n for n, (_, p) in self.peers.items() if p.popen.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"exited: {', '.join(dead)}" if dead else f"not online within {timeout:.0f} s"
                raise RuntimeError(f"peers {why}:\n" + "\n".join(self.peers[n][1].output()[-1500:] for n in dead))
            time.sleep(0.5)

    def start_trainer(self) -> JsonTail:
        log_json = self.tmp / "train.jsonl"
        p = self.plan
        args = ["train", "--coordinator", self.url, "--steps", str(p.steps), "--inflight", str(p.inflight)]
        args += ["--call-timeout", str(p.call_timeout), "--log-json", str(log_json)]
        self.trainer = Proc(args, self.tmp / "trainer.log")
        self.procs.append(self.trainer)
        return JsonTail(log_json)

    # -- the driver's moves ------------------------------------------------------------------

    def kill_coordinator(self) -> str:
        os.killpg(self.coordinator.popen.pid, signal.SIGKILL)
        self.coordinator.popen.wait()
        return "SIGKILL to the coordinator's group"

    def victims(self) -> list[str]:
        """Peers that are online and not frozen, whose stage keeps another such peer without them."""
        working = [n for n in self.peers if n != self.frozen and self.online(n)]
        per_stage = collections.Counter(self.peers[n][0] for n in working)
        return [n for n in working if per_stage[self.peers[n][0]] >= 2]

    def kill_and_replace(self, name: str) -> str:
        stage, proc = self.peers.pop(name)
        os.killpg(proc.popen.pid, signal.SIGKILL)
        proc.popen.wait()
        self.replacements += 1
        new = f"r{self.replacements}"
        self.start_peer(new, stage)
        return f"SIGKILL to peer {name}'s group (stage {stage}); replacement {new} started"

    def freeze(self, name: str) -> str:
        os.killpg(self.peers[name][1].popen.pid, signal.SIGSTOP)
        self.frozen = name
        return f"SIGSTOP to peer {name}'s group (stage {self.peers[name][0]})"

    def thaw(self) -> str:
        name, self.frozen = self.frozen, None
        if name in self.peers:
            os.killpg(self.peers[name][1].popen.pid, signal.SIGCONT)
        return f"SIGCONT to peer {name}'s group"

    def close(self) -> None:
        if self.frozen:
            self.thaw()  # a stopped group cannot act on SIGTERM
        stop_all(self.procs)

    def step_logs(self) -> list[dict]:
        return read_step_logs({p.log_path.stem: self.tmp / f"{p.log_path.stem}.steps" for p in self.procs})


def drive(run: RunConfig, plan: Plan, tmp: Path, say=print) -> Outcome:
    """Start the swarm, train `plan.steps` steps and (with `plan.chaos`) disturb it meanwhile."""
    rng = random.Random(plan.seed)
    swarm = ChaosSwarm(run, plan, tmp)
    events: list[tuple[float, str]] = []
    try:
        swarm.start_coordinator()
        for k in range(plan.stages):
            for j in range(plan.per_stage):
                swarm.start_peer(f"{'abcdefgh'[j]}{k}", k)
        swarm.wait_online()
        say(f"  {len(swarm.peers)} peers online; training {plan.steps} steps")
        tail = swarm.start_trainer()
        started = time.monotonic()
        next_kill = rng.uniform(*plan.kill_every)
        coordinator_down = freeze_done = restarted = False
        last_print = 0.0

        def event(text: str) -> None:
            t = time.monotonic() - started
            step = tail.records[-1]["step"] if tail.records else -1
            events.append((t, f"{text} (after step {step})"))
            say(f"  {t:6.1f} s  {text} (after step {step})")

        while swarm.trainer.popen.poll() is None:
            now = time.monotonic() - started
            tail.poll()
            if now > plan.timeout_s:
                raise RuntimeError(f"the trainer ran past {plan.timeout_s:.0f} s:\n{swarm.trainer.output()[-3000:]}")
            if plan.chaos:
                if not coordinator_down and not restarted and now >= plan.coordinator_at:
                    event(swarm.kill_coordinator())
                    coordinator_down = True
                elif coordinator_down and now >= plan.coordinator_at + plan.coordinator_down_s:
                    swarm.start_coordinator(wait=False)
                    event("the coordinator started again (same state directory and ports)")
                    coordinator_down, restarted = False, True
                if not freeze_done and swarm.frozen is None and now >= plan.freeze_at:
                    candidates = swarm.victims()
                    if candidates:
                        event(swarm.freeze(rng.choice(candidates)))
                        freeze_done = True
                elif swarm.frozen is not None and now >= plan.freeze_at + plan.freeze_s:
                    event(swarm.thaw())
                if now >= next_kill:
                    candidates = swarm.victims()
                    if candidates:
                        event(swarm.kill_and_replace(rng.choice(candidates)))
                        next_kill = now + rng.uniform(*plan.kill_every)
                    else:
                        next_kill = now + 1.0  # every stage is down to its last working peer: wait
            if now - last_print >= 15 and tail.records:
                last_print = now
                r = tail.records[-1]
                say(f"  {now:6.1f} s  step {r['step']}, loss {r['loss']:.3f}, calls retried {r.get('failures', 0)}")
            time.sleep(0.1)
        duration = time.monotonic() - started
        tail.poll()
        if swarm.trainer.popen.returncode != 0:
            raise RuntimeError(
                f"the trainer exited with {swarm.trainer.popen.returncode}:\n{swarm.trainer.output()[-3000:]}"
            )
    finally:
        swarm.close()
    return Outcome(plan.steps, run.training.accumulation, tail.records, swarm.step_logs(), events, duration)


def run(args: argparse.Namespace) -> str:
    plan = Plan.from_args(args)
    base = load_config(args.config)
    run_cfg = base.with_stages(plan.stages)
    tmp = log_dir(args.log_dir, "chaos")
    load_avg = os.getloadavg()[0]
    print(f"chaos: {plan.stages} stages x {plan.per_stage} peers, {plan.steps} steps; load average {load_avg:.2f}")
    print("run 1: with chaos", flush=True)
    chaos = drive(run_cfg, plan, tmp / "chaos")
    calm = None
    if not args.no_baseline:
        print("run 2: undisturbed", flush=True)
        calm = drive(run_cfg, Plan(**{**plan.__dict__, "chaos": False}), tmp / "calm")

    counted = chaos.ledger(plan.stages)
    kills = sum("SIGKILL to peer" in text for _, text in chaos.events)
    longest, longest_at = chaos.longest_step()
    val_ratio = chaos.final_val / calm.final_val if calm and chaos.final_val and calm.final_val else None
    train_ratio = chaos.final_train / calm.final_train if calm else None
    within = val_ratio is not None and abs(val_ratio - 1) <= 0.05
    rows = {
        "config": f"{args.config} cut into {plan.stages} stages, {plan.per_stage} peers each, {plan.steps} steps",
        "chaos run": f"{chaos.duration_s:.0f} s",
        "undisturbed run": f"{calm.duration_s:.0f} s" if calm else "skipped",
        "events": "\n    " + "\n    ".join(f"{t:6.1f} s  {text}" for t, text in chaos.events),
        "peers killed and replaced": kills,
        "microbatches completed (trainer)": f"{chaos.microbatches} of {plan.steps * chaos.accumulation}",
        **counted.summary(),
        "calls retried": chaos.retried,
        "longest step": f"{longest:.1f} s (step {longest_at})",
        "final val loss, chaos / undisturbed": (
            f"{chaos.final_val:.4f} / {calm.final_val:.4f} = {val_ratio:.4f}" if val_ratio else f"{chaos.final_val}"
        ),
        "final train loss (last 10 steps), chaos / undisturbed": (
            f"{chaos.final_train:.4f} / {calm.final_train:.4f} = {train_ratio:.4f}"
            if calm
            else f"{chaos.final_train:.4f}"
        ),
        "logs": str(tmp),
    }
    print("\nsummary")
    width = max(map(len, rows))
    print("\n".join(f"  {k:<{width}}  {v}" for k, v in rows.items()), flush=True)
    goal = [
        "lost met" if counted.lost == 0 else "lost NOT met",
        "twice met" if counted.applied_twice == 0 else "twice NOT met",
        ("loss met" if within else "loss NOT met") if calm else "loss not compared",
    ]
    notes = f"goal: lost 0, twice 0, final loss within 5%: {', '.join(goal)}; "
    if calm:
        notes += f"val {chaos.final_val:.4f} vs {calm.final_val:.4f} undisturbed (that run {calm.duration_s:.0f} s); "
    notes += (
        f"kills every U({plan.kill_every[0]:.0f}, {plan.kill_every[1]:.0f}) s, call timeout {plan.call_timeout:g} s, "
        f"seed {plan.seed}; load avg {load_avg:.1f} at start"
    )
    coordinator = next((t for t, text in chaos.events if "coordinator's group" in text), None)
    frozen = next((t for t, text in chaos.events if "SIGSTOP" in text), None)
    return append_row(
        SECTION,
        [
            "config",
            "steps",
            "chaos run s",
            "peers killed + replaced",
            "coordinator down",
            "peer frozen",
            "microbatches completed (trainer)",
            "microbatches lost",
            "applied twice",
            "calls retried",
            "longest step s",
            "final val loss chaos ÷ undisturbed",
            "final train loss ÷",
            "notes",
        ],
        [
            f"{args.config}, {plan.stages} stages x {plan.per_stage} peers",
            plan.steps,
            f"{chaos.duration_s:.0f}",
            kills,
            f"{plan.coordinator_down_s:.0f} s at {coordinator:.0f} s" if coordinator is not None else "-",
            f"{plan.freeze_s:.0f} s at {frozen:.0f} s" if frozen is not None else "-",
            f"{chaos.microbatches} of {plan.steps * chaos.accumulation}",
            f"{counted.lost} of {counted.sent}",
            counted.applied_twice,
            chaos.retried,
            f"{longest:.1f}",
            f"{val_ratio:.4f}" if val_ratio else "-",
            f"{train_ratio:.4f}" if train_ratio else "-",
            notes,
        ],
    )
