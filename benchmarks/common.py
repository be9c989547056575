"""What several benchmarks share: swarm processes, each in its own process group (swarm.children),
where the logs go, and reading what the trainer and the peers logged."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import get_args

from swarm.children import JsonTail, Proc, http, start_coordinator, stop_all, survivors
from swarm.config import GradCompression

__all__ = ["JsonTail", "Proc", "http", "start_coordinator", "stop_all", "survivors"]  # with the helpers below

ROOT = Path(__file__).resolve().parent.parent


# -- processes ------------------------------------------------------------------------------------


def online_names(base: str) -> set[str]:
    state = http().get(f"{base}/api/v1/state").json()
    return {p["public_name"] for s in state["stages"] for p in s["peers"] if p["state"] == "online"}


def listed_names(base: str) -> set[str]:
    state = http().get(f"{base}/api/v1/state").json()
    return {p["public_name"] for s in state["stages"] for p in s["peers"]}


def serving(base: str, stage: int) -> list[str]:
    """The public names of the peers online on `stage` now, not in the middle of a move, by the
    coordinator's view."""
    state = http().get(f"{base}/api/v1/state").json()
    peers = state["stages"][stage]["peers"] if stage < len(state["stages"]) else []
    return [p["public_name"] for p in peers if p["state"] == "online" and p.get("moving_to") is None]


def start_peer(url: str, name: str, stage: int | str, tmp: Path, *extra: str, host: str | None = None) -> Proc:
    """`swarm peer` of the run at `url` on `stage` (a number or 'auto'), one torch thread; `host`: the
    loopback address it listens on, a machine of its own (spot checks count one vote per host)."""
    args = ["peer", "--coordinator", url, "--stage", str(stage), "--public-name", name, "--threads", "1"]
    if host:
        args += ["--host", host]
    args += ["--checkpoint-dir", "none"]  # every benchmark run starts from the seeded init
    return Proc([*args, *extra], tmp / f"{name}.log")


def wait_online(url: str, peers: dict[str, Proc], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not set(peers) <= online_names(url):
        dead = [n for n, p in peers.items() if p.popen.poll() is not None]
        if dead or time.monotonic() > deadline:
            tails = "\n".join(f"--- {n}\n{peers[n].output()[-1500:]}" for n in dead or peers)
            why = "exited: " + ", ".join(dead) if dead else "timeout"
            raise RuntimeError(f"peers not online ({why}):\n{tails}")
        time.sleep(0.5)
    print(f"peers online: {', '.join(peers)}", flush=True)


def run_to_end(args: list[str], log: Path, procs: list[Proc] | None = None, every: float = 15.0) -> str:
    """`swarm ARGS` (a trainer) run to its end, output to `log` (forked from the zygote with
    SWARM_ZYGOTE=1, as the swarm's other commands: a new interpreter's imports cost about 3 s of CPU);
    its output. Appended to `procs`, when given, so that the caller's `stop_all` ends it if this is
    interrupted. Every `every` s its progress bar's latest line is printed. RuntimeError with the
    output's tail when it fails."""
    proc = Proc(args, log)
    if procs is not None:
        procs.append(proc)
    try:
        shown = time.monotonic()
        while proc.popen.poll() is None:
            time.sleep(0.2)
            if time.monotonic() - shown > every:
                shown = time.monotonic()
                lines = [line for line in re.split(r"[\r\n]", proc.output()) if line.strip()]
                print(f"  {lines[-1].strip()[:160]}" if lines else "  (no output yet)", flush=True)
    finally:
        if procs is None:
            stop_all([proc])
    out = proc.output()
    if proc.popen.returncode != 0:
        raise RuntimeError(f"swarm {args[0]} exited with {proc.popen.returncode}:\n{out[-3000:]}")
    return out


def log_dir(path: str | None, name: str) -> Path:
    """--log-dir, or a new /tmp/swarm-NAME-* folder; says where the logs go. A --log-dir that holds
    files already is refused: the peers append to the step logs they find (`--log-steps`), and the
    benchmark would count an earlier run's steps with this one's (an averaging run in a reused folder
    reported twice the bytes per step, and loss ratios from two runs' curves)."""
    tmp = Path(path) if path else Path(tempfile.mkdtemp(prefix=f"swarm-{name}-"))
    if path and tmp.is_dir() and any(tmp.iterdir()):
        raise SystemExit(f"--log-dir {tmp}: not empty (an earlier run's logs?); give a new or empty folder")
    tmp.mkdir(parents=True, exist_ok=True)
    print(f"{name}: logs in {tmp}", flush=True)
    return tmp


def without_eval(config: str, tmp: Path, name: str) -> tuple[Path, float]:
    """`config` copied into `tmp` with validation off (a validation pass would put a slow step between
    the measured ones); and the load average at the start, which the benchmark prints and reports."""
    out = tmp / "run.toml"
    out.write_text(re.sub(r"(?m)^eval_every = \d+$", "eval_every = 0", Path(config).read_text()))
    load_avg = os.getloadavg()[0]
    print(f"{name}: load average {load_avg:.2f} at start", flush=True)
    return out, load_avg


# -- logs -----------------------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_step_logs(paths: dict[str, Path]) -> list[dict]:
    """Every optimizer step in the peers' `--log-steps` files (name -> path), each with `peer`: name."""
    steps = []
    for name, path in paths.items():
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):  # a line cut short by the SIGKILL
                steps.append(dict(json.loads(line), peer=name))
    return steps


def final_loss(records: list[dict], tail: int) -> float:
    """The mean training loss of the trainer's last `tail` steps."""
    last = records[-tail:]
    return sum(r["loss"] for r in last) / len(last)


def last_val(records: list[dict]) -> float | None:
    """The trainer's last validation loss, if it had one."""
    vals = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    return vals[-1] if vals else None


def averaging_spec(text: str) -> dict:
    """An averaging variant as benchmarks name it: `COMPRESSION` (gradients averaged every step) or
    `COMPRESSION/dilocoH[-lrLR][-mM][-pinned]` (DiLoCo, H inner steps, outer learning rate and momentum,
    pinned paths: `[averaging] paths`), e.g.
    `int8/diloco10-lr1-m0` -> the [averaging] settings {"compression": "int8", "mode": "diloco",
    "inner_steps": 10, "outer_lr": 1.0, "outer_momentum": 0.0}; `powersgdR` is powersgd of rank R
    (plain `powersgd`: the config's default rank); refused with the choices."""
    compression, _, mode = text.strip().partition("/")
    choices = ", ".join(get_args(GradCompression))
    found = re.fullmatch(r"diloco(\d+)(?:-lr(\d+(?:\.\d+)?))?(?:-m(\d+(?:\.\d+)?))?(-pinned)?", mode)
    ranked = re.fullmatch(r"powersgd(\d+)", compression)
    known = compression in get_args(GradCompression) or (ranked is not None and int(ranked.group(1)) >= 1)
    if not known or (mode and (found is None or int(found.group(1)) < 1)):
        raise argparse.ArgumentTypeError(
            f"{text!r}: COMPRESSION or COMPRESSION/dilocoH[-lrLR][-mM][-pinned], with COMPRESSION one of {choices} "
            "(powersgdR: of rank R), H >= 1 inner steps, LR the outer learning rate, M its momentum, and -pinned "
            "for pinned paths"
        )
    base = {"compression": "powersgd", "rank": int(ranked.group(1))} if ranked else {"compression": compression}
    if not mode:
        return base
    settings = {**base, "mode": "diloco", "inner_steps": int(found.group(1))}
    for key, value in (("outer_lr", found.group(2)), ("outer_momentum", found.group(3))):
        if value is not None:
            settings[key] = float(value)
    if found.group(4):
        settings["paths"] = "pinned"
    return settings


def spec_name(settings: dict) -> str:
    """The name `averaging_spec` reads back."""
    compression = settings["compression"] + str(settings.get("rank", ""))
    if settings.get("mode") != "diloco":
        return compression
    name = f"{compression}/diloco{settings['inner_steps']}"
    if "outer_lr" in settings:
        name += f"-lr{settings['outer_lr']:g}"
    if "outer_momentum" in settings:
        name += f"-m{settings['outer_momentum']:g}"
    if settings.get("paths") == "pinned":
        name += "-pinned"
    return name


def with_wire(text: str, codec: str) -> str:
    """A config's text with `[wire] codec` set."""
    if re.search(r'(?m)^codec = "\w+"', text):
        return re.sub(r'(?m)^codec = "\w+"', f'codec = "{codec}"', text)
    return text + f'\n[wire]\ncodec = "{codec}"\n'


def with_eval_batches(text: str, count: int) -> str:
    """A config's text with `[training] eval_batches` set (the section added when missing)."""
    if re.search(r"(?m)^eval_batches = \d+", text):
        return re.sub(r"(?m)^eval_batches = \d+", f"eval_batches = {count}", text)
    if "[training]\n" not in text:
        return text + f"\n[training]\neval_batches = {count}\n"
    return text.replace("[training]\n", f"[training]\neval_batches = {count}\n", 1)


def with_averaging(text: str, settings: dict) -> str:
    """A config's text with these [averaging] settings (the section added when missing)."""
    lines = "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items())
    if "[averaging]\n" not in text:
        return text + f"\n[averaging]\n{lines}"
    return text.replace("[averaging]\n", f"[averaging]\n{lines}", 1)
