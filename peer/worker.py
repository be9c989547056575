"""The compute side of a stage worker: one `Stage` on one device, fed by a queue.

Requests are decoded and checked in the gRPC threads, then queued here. One compute thread takes
work in priority order (backward before forward, so gradients drain and memory is freed first),
batches concurrent requests of the same kind up to a token budget, runs them, and hands results
back. Encoding and decoding stay in the gRPC threads, so they overlap with compute.

Backward is stateless: it recomputes the forward from the input it is given. A short-lived cache
keeps the autograd graph of training forwards served alone, so that when the same peer also gets
the matching backward the recompute is skipped.

Optimizer (peer/averaging.py): each worker accumulates the gradients of the samples it served. A
lone worker steps every global batch of samples; the peers of a swarm stage average their
gradients with hivemind and step together. Requests carry the global step they belong to: a
training request for step s needs the weights after s steps, so a worker that has not yet taken
step s - 1 finishes it first (waiting for the stage's count, at most `averaging.sync_timeout_s`).

Checkpoints (peer/checkpoint.py): right after an optimizer step, on the compute thread and under the
lock that guards the weights, the worker offers its state to a `CheckpointWriter`, which copies it
when a checkpoint is due and writes it on its own thread.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
import torch.nn.functional as F

from peer.averaging import LocalUpdater, SwarmUpdater
from peer.checkpoint import Checkpoint, CheckpointWriter, Snapshot
from peer.requests import BackwardWork, CachedForward, ForwardWork, RequestError
from swarm.config import RunConfig
from swarm.device import autocast, device_name
from swarm.model import Stage

log = logging.getLogger("swarm.worker")


@dataclass
class ForwardResult:
    output: torch.Tensor | None = None
    loss: float = 0.0
    input_grad: torch.Tensor | None = None


@dataclass(order=True)
class _Task:
    priority: int
    seq: int
    work: ForwardWork | BackwardWork = field(compare=False)
    future: Future = field(compare=False)
    active: Callable[[], bool] | None = field(default=None, compare=False)  # False once the caller gave up
    enqueued: float = field(default_factory=time.perf_counter, compare=False)

    def waiting(self) -> bool:
        """Whether the caller still waits for the answer."""
        return self.active is None or self.active()

    def uncached(self) -> _Task:
        """This task to be run again from its input alone: a recorded forward's graph is spent once its
        backward ran, and an input that took part in a backward holds that gradient."""
        work = self.work
        if isinstance(work, BackwardWork) and work.cached is not None:
            work = dataclasses.replace(work, inputs=work.cached.inputs.detach().to("cpu"), cached=None)
        else:
            work = dataclasses.replace(work, inputs=work.inputs.detach())
        return dataclasses.replace(self, work=work)

    @property
    def samples(self) -> int:
        return self.work.input_shape[0]

    @property
    def tokens(self) -> int:
        return self.work.input_shape[0] * self.work.input_shape[1]


class StagedGrads:
    """Sets a module's accumulated gradients aside, so that the next backward fills fresh buffers;
    then `commit` adds those to the ones set aside, or `drop` forgets them. Either way each `.grad`
    is afterwards the tensor it was before (hivemind's averager reads them in place)."""

    def __init__(self, module: torch.nn.Module):
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.kept = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None

    def commit(self) -> None:
        with torch.no_grad():
            for p, kept in zip(self.params, self.kept, strict=True):
                if kept is None:
                    continue  # the fresh buffer (or none) stays
                if p.grad is not None:
                    kept.add_(p.grad)
                p.grad = kept

    def drop(self) -> None:
        for p, kept in zip(self.params, self.kept, strict=True):
            p.grad = kept


class WorkQueue:
    """Two FIFO lanes; backward first. `take` returns a batch of tasks of one kind and one shape."""

    def __init__(self):
        self.lanes: dict[str, collections.deque] = {"backward": collections.deque(), "forward": collections.deque()}
        self.cond = threading.Condition()
        self.closed = False

    def put(self, kind: str, task: _Task) -> None:
        with self.cond:
            self.lanes[kind].append(task)
            self.cond.notify()

    def __len__(self) -> int:
        return sum(map(len, self.lanes.values()))

    def take(self, budget: int, timeout: float = 0.5) -> tuple[str, list[_Task]] | None:
        with self.cond:
            if not self.cond.wait_for(lambda: len(self) or self.closed, timeout) or self.closed:
                return None
            kind = "backward" if self.lanes["backward"] else "forward"
            lane = self.lanes[kind]
            first = lane.popleft()
            batch, tokens = [first], first.tokens
            key = _batch_key(first.work)
            # Take more of the same kind and shape while they fit the token budget.
            while lane and _batch_key(lane[0].work) == key and tokens + lane[0].tokens <= budget:
                task = lane.popleft()
                batch.append(task)
                tokens += task.tokens
            return kind, batch

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
            for lane in self.lanes.values():
                while lane:
                    _resolve(lane.popleft().future, error=RuntimeError("the worker is shutting down"))


def _resolve(future: Future, result=None, error: BaseException | None = None) -> None:
    """Hand a result to a caller that may have given up meanwhile (its future is then cancelled)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


def _batch_key(work: ForwardWork | BackwardWork) -> tuple:
    if isinstance(work, ForwardWork):
        return ("forward", tuple(work.inputs.shape[1:]), work.inputs.dtype, work.targets is not None, work.train)
    return ("backward", work.input_shape[1:], work.output_grad.dtype, work.cached is None)


class StageWorker:
    def __init__(
        self,
        run: RunConfig,
        stage: int,
        device: torch.device,
        delay_per_sample: float = 0.0,
        step_log: Path | None = None,
        dht=None,
        checkpoints: CheckpointWriter | None = None,
        corrupt_outputs: float = 0.0,
    ):
        """`delay_per_sample` (seconds) slows the worker down, to stand in for a slower device in tests;
        `step_log` gets one JSON line per optimizer step naming the microbatches it applied; with a
        `dht`, the worker averages its steps with the other peers of its stage; `checkpoints` saves
        the stage's state every so many steps (closed with the worker); `corrupt_outputs` (tests: a
        dishonest peer) adds Gaussian noise of that scale, relative to their RMS, to forward outputs."""
        self.corrupt_outputs = corrupt_outputs
        self.run, self.stage_index, self.device = run, stage, device
        self.delay_per_sample, self.step_log, self.checkpoints = delay_per_sample, step_log, checkpoints
        self.pending_ids: list[str] = []  # microbatches accumulated since the last step
        self.stage = Stage(run, stage).to(device)
        self.stage.train()
        if dht is None:
            self.updater: LocalUpdater | SwarmUpdater = LocalUpdater(run, self.stage)
        else:
            self.updater = SwarmUpdater(run, stage, self.stage, dht, note=lambda text: print(text, flush=True))
        self.queue = WorkQueue()
        self.lock = threading.Lock()  # held while parameters or gradients change
        self.cache: collections.OrderedDict[str, CachedForward] = collections.OrderedDict()
        self._cache_lock = threading.Lock()
        self._seq = itertools.count()
        self.samples_served = 0  # samples whose gradients were accumulated
        self.samples_pending = 0  # ... since the last optimizer step
        self._next_resync = 0.0
        self.skipped_steps: list[range] = []  # global steps whose gradients never reached this stage (_catch_up)
        self.sec_per_sample = {"forward": None, "backward": None}
        self.device_name = device_name(device)
        self._thread = threading.Thread(target=self._loop, name=f"stage-{stage}-compute", daemon=True)
        self._thread.start()

    # -- submitting work -------------------------------------------------------------------

    def submit(self, work: ForwardWork | BackwardWork, active: Callable[[], bool] | None = None) -> Future:
        """Queue work; `active` tells whether the caller still waits (cancelled work is skipped)."""
        kind = "backward" if isinstance(work, BackwardWork) else "forward"
        future: Future = Future()
        self.queue.put(kind, _Task(0 if kind == "backward" else 1, next(self._seq), work, future, active))
        return future

    def load_parameters(self, params: dict[str, torch.Tensor]) -> None:
        """Take a stage's current weights (from a live peer of the stage)."""
        with self.lock:
            missing = set(dict(self.stage.named_parameters())) - set(params)
            if missing:
                raise ValueError(f"weights lack {sorted(missing)[:3]}")
            with torch.no_grad():
                for name, p in self.stage.named_parameters():
                    if params[name].shape != p.shape:
                        raise ValueError(f"{name}: shape {list(params[name].shape)}, expected {list(p.shape)}")
                    p.copy_(params[name])

    def load_checkpoint(self, checkpoint: Checkpoint) -> str:
        """Take the stage's weights, optimizer state and step from `checkpoint`; returns the source."""
        with self.lock:
            source = self.updater.load_checkpoint(checkpoint)
            with self._cache_lock:
                self.cache.clear()
        return source

    @property
    def optimizer_steps(self) -> int:
        """Global steps this stage's weights include."""
        return self.updater.epoch

    def claim_cached(self, microbatch_id: str) -> CachedForward | None:
        """Take this microbatch's recorded forward, if it is still here and still current."""
        with self._cache_lock:
            entry = self.cache.pop(microbatch_id, None)
        return entry if entry is not None and entry.version == self.optimizer_steps else None

    @property
    def throughput(self) -> float:
        """Samples per second of forward + backward, from moving averages of measured times."""
        f, b = self.sec_per_sample["forward"], self.sec_per_sample["backward"]
        if f is None and b is None:
            return 0.0
        return 1.0 / ((f or 0.0) + (b or f or 0.0))

    def close(self) -> None:
        """Refuse queued work and stop. A step still averaging is left to time out on its own
        (the thread is a daemon): leaving must not wait for the stage's all-reduce."""
        self.queue.close()
        self._thread.join(timeout=1)
        self.updater.close()
        if self.checkpoints is not None:
            self.checkpoints.close()

    # -- the compute thread ----------------------------------------------------------------

    def _loop(self) -> None:
        while not self.queue.closed:
            try:
                self._turn()
            except Exception:  # the compute thread must outlive any one failure, or the peer goes deaf
                log.exception("stage %d: compute thread error", self.stage_index)
                time.sleep(0.1)

    def _turn(self) -> None:
        """One round of the compute thread: a batch of work, or a look at the stage's step when idle."""
        got = self.queue.take(self.run.serve.max_batch_tokens, timeout=0.1)
        if got is None:
            self._maybe_step()  # the stage may have completed its batch on other peers
            return
        kind, batch = got
        try:
            self._catch_up(max(t.work.step for t in batch))
        except Exception as err:  # e.g. the stage's state could not be loaded: these callers retry elsewhere
            for task in batch:
                _resolve(task.future, error=RequestError(grpc.StatusCode.UNAVAILABLE, f"stage sync failed: {err}"))
            raise
        self._run_batch(kind, batch)

    def _run_batch(self, kind: str, batch: list[_Task]) -> None:
        batch = self._drop_cancelled(batch)
        if not batch:
            return
        start = time.perf_counter()
        for task in batch:
            task.future.queue_s = start - task.enqueued  # read by the service, reported for routing
        try:
            with self.lock:
                if kind == "backward" or (batch[0].work.train and batch[0].work.targets is not None):
                    batch, results = self._accumulate(kind, batch)
                else:
                    results = self._forward(batch)
            if not batch:
                return
            if self.delay_per_sample:
                time.sleep(self.delay_per_sample * sum(t.samples for t in batch))
        except Exception as err:  # a real fault: report it to every caller in the batch
            for task in batch:
                _resolve(task.future, error=err)
            return
        samples = sum(t.samples for t in batch)
        self._measure(kind, batch, (time.perf_counter() - start) / samples)
        for task, result in zip(batch, results, strict=True):
            if isinstance(result, Exception):
                _resolve(task.future, error=result)
            else:
                _resolve(task.future, result=result)
        self._maybe_step()  # after answering: the caller need not wait for the stage's step

    def _catch_up(self, step: int) -> None:
        """Work for global step `step` needs the weights after `step` steps: take the step before it
        first, once the stage has served its batch (or the wait for the count times out).

        The stage's step count stays the trainer's global step: a step none of whose samples reached
        a live peer of the stage (the peers that served it died with its gradients) is skipped, not
        left to shift every later step by one (each later step would then wait for a count that never
        comes, and exchange gradient norms with the other stages under the wrong step)."""
        if step > self.optimizer_steps + 1:
            self._resync()  # the peer missed steps: take the stage's state
            if step > self.optimizer_steps + 1:
                # No live peer of the stage is past them, so none holds their gradients either.
                self._skip_to(step, "no live peer of the stage took them")
        if step != self.optimizer_steps + 1:
            return  # a stale trainer's gradient counts toward the current step, as in hivemind
        deadline = time.monotonic() + self.run.averaging.sync_timeout_s
        while self.optimizer_steps < step and not self.queue.closed:
            if self.updater.behind(self.samples_pending):
                self._resync()
            elif self.updater.ready(self.samples_pending):
                with self.lock:
                    self._step()
            elif time.monotonic() > deadline:
                if self.updater.started(self.samples_pending):
                    with self.lock:
                        self._step(force=True)
                if self.optimizer_steps < step:
                    self._skip_to(step, "none of its samples reached a live peer of the stage")
                return
            else:
                time.sleep(0.02)

    def _skip_to(self, step: int, why: str) -> None:
        """Take the stage's step count to `step` without applying anything: the gradients of the
        steps in between are gone. Gradients held for an older step are dropped with them."""
        with self.lock:
            skipped = range(self.optimizer_steps, step)
            if not skipped:
                return
            self._drop_pending()
            self.updater.skip_to(step)
            self.skipped_steps.append(skipped)
            with self._cache_lock:
                self.cache.clear()
        steps = str(skipped[0]) if len(skipped) == 1 else f"{skipped[0]}-{skipped[-1]}"
        print(f"stage {self.stage_index}: skipped step(s) {steps}: {why}", flush=True)

    @staticmethod
    def _drop_cancelled(batch: list[_Task]) -> list[_Task]:
        # A caller that timed out has retried elsewhere: doing its work now would count its
        # gradient twice.
        kept = []
        for task in batch:
            if task.waiting():
                kept.append(task)
            else:
                _resolve(task.future, error=RequestError(grpc.StatusCode.CANCELLED, "the caller gave up"))
        return kept

    def _accumulate(self, kind: str, batch: list[_Task]) -> tuple[list[_Task], list]:
        """Run work that adds to the stage's gradient (backward; the last stage's training forward)
        and keep its gradient only for callers that still wait: those who gave up while it ran (the
        process was frozen, the call timed out) have retried elsewhere, and counting their
        microbatch here too would count it twice. The batch's gradient goes to fresh buffers first
        (`StagedGrads`); when some callers left, it is dropped and the rest is run again.
        Returns the tasks kept and their results."""
        while batch:
            staged = StagedGrads(self.stage)
            try:
                results = self._backward(batch) if kind == "backward" else self._forward_loss(batch)
            except BaseException:
                staged.drop()
                raise
            left = [not task.waiting() for task in batch]
            if not any(left):
                staged.commit()
                self._served([t for t, r in zip(batch, results, strict=True) if not isinstance(r, Exception)])
                return batch, results
            staged.drop()
            for task, gone in zip(batch, left, strict=True):
                if gone:
                    _resolve(task.future, error=RequestError(grpc.StatusCode.CANCELLED, "the caller gave up"))
            batch = [task.uncached() for task, gone in zip(batch, left, strict=True) if not gone]
        return [], []

    def _measure(self, kind: str, batch: list[_Task], sec: float) -> None:
        # The last stage's training forward is forward + backward in one call.
        if kind == "forward" and batch[0].work.train and self.stage.is_last:
            sec /= 2
            self._ema("backward", sec)
        self._ema(kind, sec)

    def _ema(self, kind: str, sec: float, alpha: float = 0.1) -> None:
        old = self.sec_per_sample[kind]
        self.sec_per_sample[kind] = sec if old is None else (1 - alpha) * old + alpha * sec

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def _inputs(self, batch: list[_Task]) -> torch.Tensor:
        """The batch's inputs, concatenated, on the device (float32 hidden states, or token ids)."""
        x = torch.cat([t.work.inputs for t in batch]) if len(batch) > 1 else batch[0].work.inputs
        x = self._to_device(x)
        return x if self.stage.is_first else x.float()

    def _split(self, t: torch.Tensor | None, batch: list[_Task]) -> list[torch.Tensor | None]:
        if t is None:
            return [None] * len(batch)
        return list(t.detach().to("cpu").split([task.samples for task in batch]))

    def _forward(self, batch: list[_Task]) -> list[ForwardResult]:
        first: ForwardWork = batch[0].work
        if first.targets is not None:
            return self._forward_loss(batch)
        x = self._inputs(batch)
        cache = first.train and len(batch) == 1 and self.run.serve.cache_size > 0
        with torch.set_grad_enabled(cache), autocast(self.device, self.run.model.dtype):
            if cache and not self.stage.is_first:
                x.requires_grad_(True)
            out = self._corrupt(self.stage(x))
        if cache:
            with self._cache_lock:
                self.cache[first.microbatch_id] = CachedForward(x, out, self.optimizer_steps)
                while len(self.cache) > self.run.serve.cache_size:
                    self.cache.popitem(last=False)
        return [ForwardResult(output=o) for o in self._split(out, batch)]

    def _forward_loss(self, batch: list[_Task]) -> list[ForwardResult]:
        """Last stage with targets: the loss of each request and, when training, its input gradient."""
        train = batch[0].work.train
        x = self._inputs(batch)
        targets = self._to_device(torch.cat([t.work.targets for t in batch]))
        with torch.set_grad_enabled(train):
            if train and not self.stage.is_first:
                x.requires_grad_(True)
            with autocast(self.device, self.run.model.dtype):
                logits = self._corrupt(self.stage(x))
            per_sample = F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none").mean(dim=1)
            sizes = [t.work.inputs.shape[0] for t in batch]
            losses = [chunk.mean() for chunk in per_sample.split(sizes)]
            if train:
                total = sum(loss * t.work.loss_scale for loss, t in zip(losses, batch, strict=True))
                total.backward()
        grads = self._split(x.grad if train and not self.stage.is_first else None, batch)
        return [ForwardResult(loss=float(loss.detach()), input_grad=g) for loss, g in zip(losses, grads, strict=True)]

    def _corrupt(self, out: torch.Tensor) -> torch.Tensor:
        if not self.corrupt_outputs:
            return out
        with torch.no_grad():
            noise = torch.randn_like(out) * (self.corrupt_outputs * out.float().pow(2).mean().sqrt())
        return out + noise

    def _backward(self, batch: list[_Task]) -> list[torch.Tensor | None | Exception]:
        results: list[torch.Tensor | None | Exception] = [None] * len(batch)
        recompute = []
        for i, task in enumerate(batch):
            cached = task.work.cached
            if cached is None:
                recompute.append(i)
            elif cached.version != self.optimizer_steps:
                # Only reachable when another trainer's samples completed a global batch between
                # this microbatch's forward and its backward: the caller retries with a fresh forward.
                results[i] = RequestError(grpc.StatusCode.ABORTED, "the stage took an optimizer step since the forward")
            else:
                cached.output.backward(self._to_device(task.work.output_grad).to(cached.output.dtype))
                results[i] = None if self.stage.is_first else cached.inputs.grad.detach().to("cpu")
        if recompute:
            sub = [batch[i] for i in recompute]
            x = self._inputs(sub)
            grad = self._to_device(torch.cat([t.work.output_grad for t in sub]))
            with torch.enable_grad():
                if not self.stage.is_first:
                    x.requires_grad_(True)
                with autocast(self.device, self.run.model.dtype):
                    out = self.stage(x)
                out.backward(grad.to(out.dtype))
            grads = self._split(None if self.stage.is_first else x.grad, sub)
            for i, g in zip(recompute, grads, strict=True):
                results[i] = g
        return results

    def _served(self, tasks: list[_Task]) -> None:
        samples = sum(t.samples for t in tasks)
        self.samples_served += samples
        self.samples_pending += samples
        self.pending_ids.extend(t.work.microbatch_id for t in tasks)
        self.updater.served(self.samples_pending)

    def _maybe_step(self) -> None:
        if self.updater.behind(self.samples_pending):
            if time.monotonic() >= self._next_resync:
                self._next_resync = time.monotonic() + 2
                self._resync()
        elif self.updater.ready(self.samples_pending):
            with self.lock:
                self._step()

    def _resync(self) -> None:
        """Replace this replica's state by the stage's. Gradients served toward the step the stage is
        at are kept (they were computed on weights one step away at most); older ones are dropped."""
        with self.lock:
            before = self.optimizer_steps
            params = [p for p in self.stage.parameters() if p.grad is not None]
            kept = [p.grad.clone() for p in params] if self.samples_pending else []
            source = self.updater.load_state()
            if kept and self.optimizer_steps == before:
                with torch.no_grad():
                    for p, g in zip(params, kept, strict=True):
                        p.grad.copy_(g)  # hivemind zeroed the buffers when it loaded the state
                self.updater.served(self.samples_pending)
            else:
                self._drop_pending()
        print(f"stage {self.stage_index}: caught up to step {self.optimizer_steps} from {source}", flush=True)

    def _drop_pending(self) -> None:
        """Forget the gradients accumulated since the last step (their step is gone). Under the lock."""
        if self.samples_pending:
            print(f"stage {self.stage_index}: dropped {self.samples_pending} samples' gradients", flush=True)
        self.samples_pending, self.pending_ids = 0, []
        self.stage.zero_grad(set_to_none=False)

    def _step(self, force: bool = False) -> None:
        before = self.optimizer_steps
        used = self.updater.step(self.samples_pending, force=force)
        if self.optimizer_steps == before:
            return
        with self._cache_lock:
            self.cache.clear()  # graphs recorded before the step no longer match the weights
        self.samples_pending -= used
        if self.step_log:
            with open(self.step_log, "a") as f:
                f.write(
                    json.dumps(
                        {"stage": self.stage_index, "step": self.optimizer_steps, "microbatches": self.pending_ids}
                    )
                    + "\n"
                )
        self.pending_ids = []
        if self.checkpoints is not None and not self.updater.missed:
            # A replica that missed the stage's all-reduce holds a state that is not the step's.
            self.checkpoints.offer(
                self.optimizer_steps, lambda: Snapshot.take(self.stage, self.updater.optimizer, self.optimizer_steps)
            )

    # -- state -----------------------------------------------------------------------------

    def named_tensors(self, with_grads: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        with self.lock:
            params = {n: p.detach().to("cpu").clone() for n, p in self.stage.named_parameters()}
            grads = {}
            if with_grads:
                grads = {
                    n: p.grad.detach().to("cpu").clone() for n, p in self.stage.named_parameters() if p.grad is not None
                }
        return params, grads
