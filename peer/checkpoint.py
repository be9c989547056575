"""Peer checkpoints: a stage's weights, optimizer state and step, saved in the background.

Layout, one folder per saved step, newest `keep` kept per stage:

    {root}/{run_id}/stage{k}/step{N:08d}/
        weights.safetensors     the stage's parameters, under their names in the model
        optimizer.safetensors   the optimizer's state tensors (AdamW's moments and step counts)
        optimizer.json          the rest of the optimizer's state_dict (param groups), tensors by key
        checkpoint.json         run_id, stage, layers, step, model_hash, saved_at, version, files' sha256

Taking one: at an optimizer-step boundary the thread that owns the model copies the state to CPU
(a `Snapshot`) and hands it to a `CheckpointWriter`, whose own thread serialises it, so the worker
never waits for the disk. A snapshot due while the last one is still being written is skipped: at
most one is ever held in memory. A checkpoint is written into a temporary folder that is renamed
into place once complete, so a folder named `step…` is whole or absent.

Reading one: `latest_checkpoint` returns the newest folder whose checkpoint.json matches the run,
stage, layers and model hash and whose files match their recorded digests; anything else (another
model, a truncated or corrupt file, an unknown format) is skipped with a log line, never loaded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from swarm import __version__
from swarm.config import RunConfig

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
WEIGHTS, OPTIMIZER, OPTIMIZER_LAYOUT, META = (
    "weights.safetensors",
    "optimizer.safetensors",
    "optimizer.json",
    "checkpoint.json",
)
STEP_DIR = re.compile(r"^step(\d{8,})$")


class CheckpointError(Exception):
    """A checkpoint that cannot be used: the message says why."""


def stage_dir(root: Path, run_id: str, stage: int) -> Path:
    return Path(root) / run_id / f"stage{stage}"


def writable_dir(root: Path) -> Path:
    """Create `root` if needed and prove a file can be written there (OSError otherwise)."""
    root = Path(root).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=root, prefix=".probe-"):
        pass
    return root


# -- the state in memory -----------------------------------------------------------------------


def _split_tensors(value, key: str, tensors: dict[str, torch.Tensor]):
    """`value` with every tensor replaced by {"tensor": key}, the tensor copied to CPU into `tensors`.

    safetensors stores a flat map of names to tensors; an optimizer's state_dict is nested (per
    parameter index, per statistic) and carries plain values (the param groups), which go to JSON."""
    if isinstance(value, torch.Tensor):
        tensors[key] = value.detach().to("cpu", copy=True).contiguous()
        return {"tensor": key}
    if isinstance(value, dict):
        return {str(k): _split_tensors(v, f"{key}.{k}", tensors) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_split_tensors(v, f"{key}.{i}", tensors) for i, v in enumerate(value)]
    return value


def _join_tensors(value, tensors: dict[str, torch.Tensor]):
    if isinstance(value, dict):
        if set(value) == {"tensor"}:
            if value["tensor"] not in tensors:
                raise CheckpointError(f"{OPTIMIZER} lacks the tensor {value['tensor']!r}")
            return tensors[value["tensor"]]
        return {k: _join_tensors(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_join_tensors(v, tensors) for v in value]
    return value


@dataclass
class Snapshot:
    """A stage's state after `step` optimizer steps, in CPU memory, apart from the live model."""

    step: int
    weights: dict[str, torch.Tensor]
    optimizer_layout: dict  # the optimizer's state_dict, each tensor replaced by {"tensor": key}
    optimizer_tensors: dict[str, torch.Tensor]

    @classmethod
    def take(
        cls, module: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, outer: torch.optim.Optimizer | None
    ) -> Snapshot:
        """Copy the state now. Call it between optimizer steps, on the thread that runs them. `outer`:
        DiLoCo's outer optimizer (its momentum), whose state goes under the layout's key "outer"."""
        with torch.no_grad():
            weights = {n: p.detach().to("cpu", copy=True).contiguous() for n, p in module.named_parameters()}
            tensors: dict[str, torch.Tensor] = {}
            layout = _split_tensors(optimizer.state_dict(), "optimizer", tensors)
            if outer is not None:
                layout["outer"] = _split_tensors(outer.state_dict(), "outer", tensors)
        return cls(step, weights, layout, tensors)

    def apply(
        self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, outer: torch.optim.Optimizer | None = None
    ) -> None:
        """Put this state into `module`, `optimizer` and (DiLoCo) `outer` (checked first: a mismatch
        changes nothing). A checkpoint without an outer state leaves `outer`'s as it is."""
        params = dict(module.named_parameters())
        if set(params) != set(self.weights):
            missing, extra = sorted(set(params) - set(self.weights)), sorted(set(self.weights) - set(params))
            raise CheckpointError(f"weights do not match the stage: missing {missing[:3]}, unexpected {extra[:3]}")
        for name, p in params.items():
            if self.weights[name].shape != p.shape:
                raise CheckpointError(f"{name}: shape {list(self.weights[name].shape)}, expected {list(p.shape)}")
        state = _join_tensors(self.optimizer_layout, self.optimizer_tensors)
        loads = [(optimizer, _fitted(state, optimizer, "optimizer"))]
        if outer is not None and "outer" in state:
            loads.append((outer, _fitted(state["outer"], outer, "outer optimizer")))
        for opt, loaded in loads:
            try:
                opt.load_state_dict(loaded)
            except (KeyError, TypeError, ValueError) as err:
                raise CheckpointError(f"optimizer state does not fit this stage's optimizer: {err}") from None
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(self.weights[name])


def _fitted(saved: dict, opt: torch.optim.Optimizer, what: str) -> dict:
    """A saved optimizer state_dict put in the form `opt.load_state_dict` takes, or CheckpointError."""
    try:
        groups = zip(saved["param_groups"], opt.param_groups, strict=True)
        return {
            "state": {int(k): v for k, v in saved["state"].items()},
            "param_groups": [_tuples_like(g, live) for g, live in groups],
        }
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise CheckpointError(f"{what} state does not fit this stage's {what}: {err}") from None


def _tuples_like(saved: dict, live: dict) -> dict:
    # JSON has no tuples: a value the live optimizer holds as a tuple (AdamW's betas) becomes one again.
    return {k: tuple(v) if isinstance(live.get(k), tuple) and isinstance(v, list) else v for k, v in saved.items()}


# -- on disk -----------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def expected_meta(run: RunConfig, stage: int) -> dict:
    """What checkpoint.json must say for a checkpoint to be loaded into `stage` of `run`."""
    return {
        "version": FORMAT_VERSION,
        "run_id": run.run_id,
        "stage": stage,
        "layers": list(run.stage_layers(stage)),
        "model_hash": run.model_hash(),
    }


def write_checkpoint(root: Path, run: RunConfig, stage: int, snapshot: Snapshot, keep: int = 2) -> Path:
    """Write `snapshot` as `{root}/{run_id}/stage{k}/step{N:08d}` and keep the newest `keep`
    checkpoints of the stage; returns the folder."""
    folder = stage_dir(root, run.run_id, stage)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"step{snapshot.step:08d}"
    tmp = folder / f".tmp-{os.getpid()}-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_file(snapshot.weights, tmp / WEIGHTS, metadata={"step": str(snapshot.step)})
        save_file(snapshot.optimizer_tensors, tmp / OPTIMIZER, metadata={"step": str(snapshot.step)})
        (tmp / OPTIMIZER_LAYOUT).write_text(json.dumps(snapshot.optimizer_layout))
        files = {name: _sha256(tmp / name) for name in (WEIGHTS, OPTIMIZER, OPTIMIZER_LAYOUT)}
        meta = dict(expected_meta(run, stage), step=snapshot.step, saved_at=time.time(), swarm=__version__)
        (tmp / META).write_text(json.dumps(dict(meta, files=files), indent=1))
        for name in (*files, META):
            _fsync(tmp / name)  # the rename below must not reach the disk before the files do
        try:
            tmp.rename(final)
        except OSError:
            try:
                # Another replica of the stage sharing this folder saved the same step: the replicas'
                # states are equal, so its copy serves as well.
                check_checkpoint(final, run, stage)
                shutil.rmtree(tmp, ignore_errors=True)
            except CheckpointError as err:
                log.warning("replacing checkpoint %s: %s", final, err)
                shutil.rmtree(final, ignore_errors=True)
                tmp.rename(final)
        _fsync(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune(folder, keep, expected_meta(run, stage))
    return final


def _steps(folder: Path) -> list[tuple[int, Path]]:
    """The stage's checkpoint folders, newest first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found, reverse=True)


def _meta(path: Path) -> dict:
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def prune(folder: Path, keep: int, ours: dict) -> None:
    """Remove all but the newest `keep` checkpoints whose checkpoint.json says `ours` (those of
    another model saved under the same run id are left alone), and temporary folders of writers
    that are gone."""
    mine = [path for _, path in _steps(folder) if ours.items() <= _meta(path).items()]
    for path in mine[keep:]:
        shutil.rmtree(path, ignore_errors=True)
    for path in folder.glob(".tmp-*"):
        pid = path.name.split("-")[1]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # no signal is sent: only whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint folder whose metadata and file digests were checked."""

    path: Path
    step: int
    meta: dict

    def load(self) -> Snapshot:
        try:
            weights = load_file(self.path / WEIGHTS)
            tensors = load_file(self.path / OPTIMIZER)
            layout = json.loads((self.path / OPTIMIZER_LAYOUT).read_text())
        except (OSError, SafetensorError, ValueError) as err:
            raise CheckpointError(f"{self.path}: {err}") from None
        return Snapshot(self.step, weights, layout, tensors)


def check_checkpoint(path: Path, run: RunConfig, stage: int) -> Checkpoint:
    """The checkpoint in `path` if it belongs to `stage` of `run` and is intact; CheckpointError if not."""
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"no readable {META}: {err}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{META} is not an object")
    for key, want in expected_meta(run, stage).items():
        if meta.get(key) != want:
            raise CheckpointError(f"{key} is {meta.get(key)!r}, this peer needs {want!r}")
    m = STEP_DIR.match(path.name)
    if not isinstance(meta.get("step"), int) or m is None or int(m.group(1)) != meta["step"]:
        raise CheckpointError(f"step {meta.get('step')!r} does not match the folder's name")
    files = meta.get("files")
    if not isinstance(files, dict) or set(files) != {WEIGHTS, OPTIMIZER, OPTIMIZER_LAYOUT}:
        raise CheckpointError(f"{META} does not list the checkpoint's files")
    for name, digest in files.items():
        try:
            actual = _sha256(path / name)
        except OSError as err:
            raise CheckpointError(f"{name}: {err.strerror or err}") from None
        if actual != digest:
            raise CheckpointError(f"{name} is damaged (its sha256 differs from the one saved with it)")
    return Checkpoint(path, meta["step"], meta)


def latest_checkpoint(root: Path, run: RunConfig, stage: int) -> Checkpoint | None:
    """The newest intact checkpoint of `stage` of `run` under `root`, or None."""
    for _, path in _steps(stage_dir(root, run.run_id, stage)):
        try:
            return check_checkpoint(path, run, stage)
        except CheckpointError as err:
            log.warning("skipping checkpoint %s: %s", path, err)
    return None


# -- in the background -------------------------------------------------------------------------


class CheckpointWriter:
    """Saves a stage's snapshot every `every` optimizer steps (`offer`) on a thread of its own.

    `offer` is called by the worker after each step; it takes the snapshot only when one is due
    and the last one has been written. `before_write` runs on the writer's thread before each
    write (tests: a slow disk)."""

    def __init__(
        self,
        root: Path,
        run: RunConfig,
        stage: int,
        every: int,
        keep: int = 2,
        note: Callable[[str], None] = log.info,
        before_write: Callable[[Snapshot], None] | None = None,
    ):
        if every < 1 or keep < 1:
            raise ValueError("every and keep must be at least 1")
        self.root, self.run, self.stage, self.every, self.keep = Path(root), run, stage, every, keep
        self.note, self.before_write = note, before_write
        self.folder = stage_dir(self.root, run.run_id, stage)
        self.saved: list[int] = []  # steps written, oldest first
        self.skipped: list[int] = []  # steps not saved because the writer was still busy
        self._cond = threading.Condition()
        self._pending: Snapshot | None = None
        self._writing: int | None = None  # the step being written, None when idle
        self._mark: int | None = None  # the last step offered // every
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"stage-{stage}-checkpoints", daemon=True)
        self._thread.start()

    def offer(self, step: int, take: Callable[[], Snapshot]) -> bool:
        """Take a snapshot with `take` and queue it, if one is due at `step` and the writer is free.

        One is due at each multiple of `every`, or, when the steps offered passed over it (a
        replica that skipped steps; DiLoCo, whose replicas offer only the steps that end a phase),
        at the first step offered after it."""
        mark, last = step // self.every, self._mark
        self._mark = mark
        if (mark <= last) if last is not None else step % self.every:
            return False
        with self._cond:
            if self._closed:
                return False
            if self._writing is not None:
                if not self.skipped:
                    self.note(
                        f"stage {self.stage}: checkpoint of step {step} skipped, step {self._writing} is still being "
                        f"written (a slow disk?); further skips are counted, not reported"
                    )
                self.skipped.append(step)
                return False
            self._writing = step
        try:
            snapshot = take()
        except BaseException:
            with self._cond:
                self._writing = None
            raise
        with self._cond:
            self._pending = snapshot
            self._cond.notify_all()
        return True

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return
                snapshot, self._pending = self._pending, None
            try:
                if self.before_write is not None:
                    self.before_write(snapshot)
                path = write_checkpoint(self.root, self.run, self.stage, snapshot, self.keep)
                self.saved.append(snapshot.step)
                self.note(f"stage {self.stage}: checkpoint of step {snapshot.step} saved to {path}")
            except Exception as err:  # a full disk must not end the peer: training goes on without it
                log.exception("stage %d: checkpoint of step %d failed", self.stage, snapshot.step)
                self.note(f"stage {self.stage}: checkpoint of step {snapshot.step} failed: {err}")
            finally:
                with self._cond:
                    self._writing = None
                    self._cond.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no snapshot is being written; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._writing is None, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Finish the write in progress (at most `timeout` s; an unfinished one leaves only a
        temporary folder, removed by a later writer) and stop."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self.skipped:
            self.note(f"stage {self.stage}: {len(self.skipped)} checkpoint(s) skipped while the writer was busy")
