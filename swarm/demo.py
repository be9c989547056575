"""`swarm demo`: the whole swarm on one machine, from start to a trained, exported model.

The demo starts, as child processes each in its own process group (swarm.children), a coordinator,
`stages` x `replicas` peers and a trainer on the run's corpus. It prints the dashboard's address
first, shows one progress bar for the run (global step, loss, tokens/s, peers online), then gathers
the model from the peers into a Hugging Face checkpoint (swarm.export), prints a text sample drawn
from that export and a summary table, and ends every child. Ctrl-C or SIGTERM at any point ends
every child too (their whole process groups, so no DHT process or p2pd is left behind) and frees
the ports.

Everything the run writes lies in the work folder (default `./swarm-demo`): the effective config
(`run.toml`), each child's log (`logs/`), the coordinator's state, the peers' checkpoints and the
exported model (`model/`). Each demo starts afresh there.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from pydantic import ValidationError
from tqdm import tqdm

from swarm.children import JsonTail, Proc, stop_all
from swarm.config import ConfigError, RunConfig, dump_config, format_validation_error, load_config
from swarm.ready import CoordinatorReady, NotReady, wait_ready

DEFAULT_CONFIG = Path(__file__).with_name("demo.toml")
MARKER = ".swarm-demo"  # a work folder holding this file was made by the demo and may be emptied by it
START_TIMEOUT_S = 180.0  # for the coordinator to serve and every peer to come online
POLL_S = 0.5


@dataclass(frozen=True)
class DemoOptions:
    config: Path | None = None
    stages: int | None = None
    replicas: int = 1
    steps: int | None = None
    port: int = 8000
    workdir: Path = Path("swarm-demo")
    prompt: str = "The "
    sample_tokens: int = 200
    inflight: int = 4


class DemoFailed(RuntimeError):
    """A child failed; the message says which and ends with its log's last lines."""


def demo_run(opts: DemoOptions) -> RunConfig:
    """The run the demo trains: the config (the embedded demo.toml by default) cut into `stages`,
    with its schedule's horizon set to the demo's steps so the learning rate decays within the run."""
    run = load_config(opts.config or DEFAULT_CONFIG)
    data = run.model_dump()
    if opts.stages is not None:
        data["stages"] = {"count": opts.stages, "layers": None}
    if opts.steps is not None:
        data["training"]["steps"] = opts.steps
        data["training"]["warmup_steps"] = min(run.training.warmup_steps, opts.steps // 4)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, "swarm demo")) from None


def checkport_free(host: str, port: int) -> None:
    """Whether a server could listen on the port now (as uvicorn does, with SO_REUSEADDR: connections
    of a server that has ended, left in TIME_WAIT, do not hold it)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as err:
            raise ConfigError(f"--port {port}: cannot listen on {host}:{port} ({err.strerror}); pick another") from None


def prepare_workdir(path: Path) -> Path:
    """An empty work folder: created when missing, emptied when an earlier demo made it; any other
    non-empty folder is refused, so the demo never deletes what it did not write."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--workdir {path}: not a folder")
    if path.is_dir() and any(path.iterdir()):
        if not (path / MARKER).exists():
            raise ConfigError(f"--workdir {path}: not empty and not made by swarm demo; give an empty or new folder")
        shutil.rmtree(path)
    try:
        (path / "logs").mkdir(parents=True, exist_ok=True)
        (path / MARKER).write_text("made by swarm demo; emptied by the next demo run in this folder\n")
    except OSError as err:
        raise ConfigError(f"--workdir {path}: cannot write there ({err.strerror})") from None
    return path


def _tail(proc: Proc, lines: int = 25) -> str:
    return "\n".join(proc.output().splitlines()[-lines:])


class Demo:
    def __init__(self, opts: DemoOptions, run: RunConfig, workdir: Path, host: str = "127.0.0.1"):
        self.opts, self.run, self.workdir = opts, run, workdir
        self.url = f"http://{host}:{opts.port}"
        self.peers: list[Proc] = []
        self.pids: dict[str, int] = {}
        self.coordinator: Proc | None = None
        self.trainer: Proc | None = None
        self.http = httpx.Client(timeout=3.0)
        self.state: dict = {}
        self.started = time.monotonic()

    def child(self, name: str, args: list[str], ready: bool = False) -> Proc:
        """A child `swarm` process; `children.json` lists each one's process id (its process group)."""
        proc = Proc(args, self.workdir / "logs" / f"{name}.log", ready=ready)
        self.pids[name] = proc.popen.pid
        (self.workdir / "children.json").write_text(json.dumps(self.pids, indent=1) + "\n")
        return proc

    def children(self) -> list[Proc]:
        return [p for p in (*self.peers, self.trainer, self.coordinator) if p is not None]

    def refresh_state(self) -> dict:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            self.state = self.http.get(f"{self.url}/api/v1/state").json()
        return self.state

    def online(self) -> int:
        return sum(p["state"] == "online" for s in self.state.get("stages", []) for p in s["peers"])

    def check_alive(self) -> None:
        for proc in self.children():
            if proc is not self.trainer and proc.popen.poll() is not None:
                raise DemoFailed(f"{proc.log_path.stem} exited with {proc.popen.returncode}:\n{_tail(proc)}")

    def start(self) -> None:
        """The coordinator, then every peer; returns once all of them are online."""
        config = self.workdir / "run.toml"
        config.write_text(dump_config(self.run))
        state_dir = str(self.workdir / "coordinator-state")
        self.coordinator = self.child(
            "coordinator",
            ["coordinator", "--config", str(config), "--port", str(self.opts.port), "--state-dir", state_dir],
            ready=True,
        )
        try:
            wait_ready(self.coordinator, CoordinatorReady, START_TIMEOUT_S)
        except NotReady as err:
            raise DemoFailed(f"the coordinator did not start: {err}") from None
        replicas = self.opts.replicas
        for stage in range(self.run.stages.count):
            for r in range(replicas):
                name = f"peer-{stage}" + (f"-{r}" if replicas > 1 else "")
                args = ["peer", "--coordinator", self.url, "--stage", str(stage), "--public-name", name]
                # checkpoints in the work folder: a later demo, which empties it, never resumes them
                checkpoints = ["--checkpoint-dir", str(self.workdir / "checkpoints")]
                self.peers.append(self.child(name, [*args, "--threads", "1", "--no-rebalance", *checkpoints]))
        total = len(self.peers)
        deadline = time.monotonic() + START_TIMEOUT_S
        with tqdm(total=total, desc="peers online", unit="peer", leave=False) as bar:
            while self.online() < total:
                self.check_alive()
                if time.monotonic() > deadline:
                    online = self.online()
                    raise DemoFailed(f"only {online} of {total} peers came online within {START_TIMEOUT_S:.0f} s")
                time.sleep(POLL_S)
                self.refresh_state()
                bar.n = min(self.online(), total)
                bar.refresh()

    def train(self, steps: int) -> list[dict]:
        """The trainer, followed on one progress bar until it ends; its per-step records."""
        log_json = self.workdir / "train.jsonl"
        args = ["train", "--coordinator", self.url, "--steps", str(steps), "--log-json", str(log_json)]
        self.trainer = self.child("trainer", [*args, "--inflight", str(self.opts.inflight)])
        tail = JsonTail(log_json)
        postfix: dict[str, str] = {}
        with tqdm(total=steps, desc="training", unit="step", dynamic_ncols=True) as bar:
            while True:
                done = self.trainer.popen.poll() is not None
                tail.poll()
                self.refresh_state()
                if tail.records:
                    last = tail.records[-1]
                    postfix["loss"] = f"{last['loss']:.3f}"
                    vals = [r["val_loss"] for r in tail.records if "val_loss" in r]
                    if vals:
                        postfix["val"] = f"{vals[-1]:.3f}"
                    postfix["tok/s"] = f"{last['tokens_per_s']:.0f}"
                postfix["peers"] = f"{self.online()}/{len(self.peers)}"
                bar.n = len(tail.records)
                bar.set_postfix(postfix, refresh=False)
                bar.refresh()
                if done:
                    break
                self.check_alive()
                time.sleep(POLL_S)
        if self.trainer.popen.returncode != 0:
            raise DemoFailed(f"the trainer exited with {self.trainer.popen.returncode}:\n{_tail(self.trainer)}")
        return tail.records

    def stop(self) -> int:
        """Every child ended: peers and trainer first (they leave through the DHT), the coordinator
        last. Returns how many processes were still running."""
        running = sum(p.popen.poll() is None for p in self.children())
        stop_all([p for p in self.children() if p is not self.coordinator])
        if self.coordinator is not None:
            stop_all([self.coordinator])
        self.http.close()
        return running


def summary_table(rows: dict[str, str]) -> str:
    width = max(map(len, rows))
    return "\n".join(["summary"] + [f"  {k:<{width}}  {v}" for k, v in rows.items()])


def run_demo(opts: DemoOptions) -> int:
    run = demo_run(opts)
    steps = run.training.steps
    checkport_free("127.0.0.1", opts.port)
    workdir = prepare_workdir(opts.workdir)
    demo = Demo(opts, run, workdir)
    peers = run.stages.count * opts.replicas
    print(f"dashboard: {demo.url}/", flush=True)
    print(
        f"swarm demo: run '{run.run_id}', {run.stages.count} stages x {opts.replicas} peers, {steps} steps; "
        f"logs in {workdir / 'logs'}",
        flush=True,
    )

    def on_term(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt  # the same way out as Ctrl-C

    previous = signal.signal(signal.SIGTERM, on_term)
    # Ctrl-C must stop the demo even when it was started where SIGINT is ignored (a script's background
    # job inherits that, and Python then installs no handler of its own).
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        demo.start()
        records = demo.train(steps)
        state = demo.refresh_state()
        from swarm.export import export_swarm
        from swarm.generate import load_export, sample
        from swarm.tokenizer import load_tokenizer

        exported = export_swarm(demo.url, workdir / "model", note=lambda text: print(text, flush=True))
        model, exported_run = load_export(workdir / "model")
        text, _ = sample(model, load_tokenizer(exported_run.data.tokenizer), opts.prompt, opts.sample_tokens)
        print(f"\nsample from the exported model (prompt {opts.prompt!r}):\n{'-' * 72}\n{text}\n{'-' * 72}")
        baseline = _unigram(run)
        print(summary_table(_summary_rows(records, state, baseline, peers, exported, demo.started)), flush=True)
        code = 0
    except KeyboardInterrupt:
        print("\nswarm demo: interrupted", flush=True)
        code = 130
    except DemoFailed as err:
        print(f"error: {err}", flush=True)
        code = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # nothing interrupts the clean-up
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        running = demo.stop()
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
    freed = port_free(opts.port)
    print(
        f"swarm demo: all {len(demo.pids)} child processes have ended ({running} stopped), with all they started; "
        f"port {opts.port} {'is free' if freed else 'is STILL IN USE'}",
        flush=True,
    )
    return code


def _unigram(run: RunConfig) -> float:
    from swarm.data import TrainStream

    return TrainStream.local(run.data, run.model.seq_len, run.training.seed).unigram_loss()


def _summary_rows(
    records: list[dict], state: dict, baseline: float, peers: int, exported, started: float
) -> dict[str, str]:
    last = records[-1] if records else {}
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    # The demo's one trainer logs its running totals at every step: exact, where its DHT record (refreshed
    # every few seconds, gone once it expires) still said 0 after a run of a few seconds.
    trainers = state.get("trainers", [])
    wire = last.get("wire_bytes", sum(t.get("wire_bytes", 0) for t in trainers))
    failures = last.get("failures", sum(t.get("failures", 0) for t in trainers))
    return {
        "steps": str(len(records)),
        "final train loss": f"{last['loss']:.4f}" if last else "-",
        "final val loss": f"{vals[-1]:.4f}" if vals else "-",
        "unigram baseline": f"{baseline:.4f} (val loss of a model that ignores context)",
        "tokens/s": f"{last.get('tokens_per_s', 0):,.0f}",
        "wire bytes": f"{wire:,}",
        "failures survived": str(failures),
        "peers": str(peers),
        "model": f"{exported.out} (step {exported.step}, {exported.parameters:,} parameters)",
        "elapsed": f"{time.monotonic() - started:.0f} s",
    }


def port_free(port: int) -> bool:
    """Whether a server could listen on 127.0.0.1:port now."""
    try:
        checkport_free("127.0.0.1", port)
    except ConfigError:
        return False
    return True
