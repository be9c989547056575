"""The compute side of a stage worker: one `Stage` on one device, fed by a queue.

Requests are decoded and checked in the gRPC threads, then queued (peer/queue.py). One compute
thread takes work in priority order (backward before forward, so gradients drain and memory is
freed first), batches concurrent requests of the same kind up to a token budget, runs them, and
hands results back. Encoding and decoding stay in the gRPC threads, so they overlap with compute.

Backward is stateless: it recomputes the forward from the input it is given. A short-lived cache
keeps the autograd graph of each training forward (one graph per request, also when requests came
together), so that when the same peer also gets the matching backward the recompute is skipped.
A graph is used at the weights it was recorded on. The stage's step changes the weights in place, so
a graph recorded before it is dropped, but for a trainer with delayed updates (`delayed`): the
weights are copied before the step (`WeightsAt`), and its backward runs on the graph as recorded, a
gradient one step stale that counts toward the next step, as SWARM's delayed parameter updates have
it, instead of running the forward again on the new weights.

A spot check's answer (`check`: a last-stage forward's loss and input gradient, a backward's input
gradient) is computed as a training call's would be, and keeps no gradient. A training call's
gradient can be taken back by its caller until the stage steps with it (`retract`): the trainer's
spot checks outvoted its answer. It is computed again, negated, from the request kept for that.

Optimizer steps (peer/stepper.py): each worker accumulates the gradients of the samples it served;
its `Stepper` takes the stage's steps, alone or averaged with the other peers of the stage, and
keeps the weights at the step each request names before the request runs.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import grpc
import torch
import torch.nn.functional as F

from peer.averaging import grads_finite
from peer.checkpoint import Checkpoint, CheckpointWriter
from peer.options import NO_FAULTS, Faults
from peer.queue import Task, WorkQueue, accumulates, gave_up, resolve, still_waiting
from peer.requests import BackwardWork, CachedForward, ForwardWork, RequestError
from peer.stepper import StagedGrads, Stepper, make_updater
from swarm.config import RunConfig
from swarm.device import autocast, device_name
from swarm.model import Stage

log = logging.getLogger(__name__)


@dataclass
class ForwardResult:
    output: torch.Tensor | None = None
    loss: float = 0.0
    input_grad: torch.Tensor | None = None


@dataclass
class _SavedWeight:
    """A weight (or a view of one) that a recorded graph saved for its backward."""

    index: int
    tensor: torch.Tensor


class WeightsAt:
    """The stage's trainable weights at one version (`StageWorker.weights_version`), as graphs
    recorded on them see them: the parameters themselves until the weights are about to change, a
    copy from then on (`keep`). Graphs are recorded under its `hooks`, which save a weight by
    reference and hand the copy back in backward once there is one: autograd would otherwise refuse
    the backward (the step changed a saved tensor in place) or, with no check, use the new weights."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self._storages: dict[int, int] = {}  # a weight's storage -> its index, from the first `hooks`
        self.kept: list[torch.Tensor] | None = None
        self.watched = False  # a graph was recorded under `hooks`: its backward may come after a step

    def keep(self) -> None:
        """Copy the weights as they are now; before they change in place. Under the worker's lock."""
        if self.kept is None:
            with torch.no_grad():
                # Whole storages, flat: a saved view is rebuilt with its own size, stride and offset.
                self.kept = [p.new_empty(0).set_(p.untyped_storage().clone()) for p in self.params]

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        if not self.watched:  # only delayed trainers' graphs are watched: nothing to map for the others
            self._storages = {p.untyped_storage().data_ptr(): i for i, p in enumerate(self.params)}
        self.watched = True
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor | _SavedWeight:
        index = self._storages.get(t.untyped_storage().data_ptr())
        return t if index is None else _SavedWeight(index, t)

    def _unpack(self, saved: torch.Tensor | _SavedWeight) -> torch.Tensor:
        if not isinstance(saved, _SavedWeight):
            return saved
        t = saved.tensor
        if self.kept is None:
            return t
        return self.kept[saved.index].as_strided(t.size(), t.stride(), t.storage_offset())


class ForwardCache:
    """The recorded graphs of training forwards, newest last, at most `size` of them."""

    def __init__(self, size: int):
        self.size = size
        self.entries: collections.OrderedDict[str, CachedForward] = collections.OrderedDict()
        self.lock = threading.Lock()

    def put(self, microbatch_id: str, entry: CachedForward) -> None:
        with self.lock:
            self.entries[microbatch_id] = entry
            while len(self.entries) > self.size:
                self.entries.popitem(last=False)

    def claim(self, microbatch_id: str, version: int) -> CachedForward | None:
        """Take this microbatch's recorded forward, if it is still here and usable at `version`."""
        with self.lock:
            entry = self.entries.pop(microbatch_id, None)
        return entry if entry is not None and usable(entry, version) else None

    def keep_usable(self, version: int) -> None:
        """Drop the graphs that cannot be used at `version` (the weights changed)."""
        with self.lock:
            for mb_id in [m for m, e in self.entries.items() if not usable(e, version)]:
                del self.entries[mb_id]


def usable(entry: CachedForward, version: int) -> bool:
    """A recorded graph can serve its backward at weights `version`: it was recorded at that version,
    or it is a delayed trainer's recorded one step before, on weights copied before they changed."""
    if entry.version == version:
        return True
    return entry.delayed and entry.version == version - 1 and entry.weights.kept is not None


class ServiceTimes:
    """Moving averages of the seconds a sample takes forward and backward on this worker."""

    def __init__(self, alpha: float = 0.1):
        self.alpha = alpha
        self.sec_per_sample: dict[str, float | None] = {"forward": None, "backward": None}

    def observe(self, kind: str, sec: float) -> None:
        old = self.sec_per_sample[kind]
        self.sec_per_sample[kind] = sec if old is None else (1 - self.alpha) * old + self.alpha * sec

    @property
    def throughput(self) -> float:
        """Samples per second of forward + backward (0 before anything was measured)."""
        f, b = self.sec_per_sample["forward"], self.sec_per_sample["backward"]
        if f is None and b is None:
            return 0.0
        return 1.0 / ((f or 0.0) + (b or f or 0.0))


class StageWorker:
    """Runs one stage's forwards and backwards on one device, a batch at a time, on its own thread."""

    def __init__(
        self,
        run: RunConfig,
        stage: int,
        device: torch.device,
        dht=None,
        checkpoints: CheckpointWriter | None = None,
        faults: Faults = NO_FAULTS,
        cache_size: int | None = None,
    ):
        """With a `dht`, the worker averages its steps with the other peers of its stage;
        `checkpoints` saves the stage's state every so many steps (closed with the worker); `faults`:
        what a test makes this worker do wrong (peer/options.py); `cache_size`: the forward graphs
        kept for their backward (default `serve.cache_size`), which bounds its activation memory."""
        self.run, self.stage_index, self.device, self.faults = run, stage, device, faults
        self.stage = Stage(run, stage).to(device)
        self.stage.train()
        self.updater = make_updater(run, stage, self.stage, dht, idle=self._serve_aside, declared=faults.declared)
        self.queue = WorkQueue()
        self.busy_s = 0.0  # time the compute thread spent serving batches
        self.recomputed = 0  # samples whose training backward ran their forward again (no graph of it kept)
        self.stale_backwards = 0  # samples whose backward ran on a graph recorded before a step (delayed)
        self.lock = threading.Lock()  # held while parameters or gradients change
        self.cache = ForwardCache(run.serve.cache_size if cache_size is None else cache_size)
        # Goes up whenever the weights change (a step, a skip, or the stage's state or a checkpoint
        # loaded in place): a recorded forward is used only at the version it was recorded at, or a
        # delayed trainer's one version later (`usable`).
        self.weights_version = 0
        self.weights = self._weights_now()
        # The requests of the gradients kept lately, by microbatch id, for `retract` (the newest last).
        self.retractable: collections.OrderedDict[str, ForwardWork | BackwardWork] = collections.OrderedDict()
        self.retractable_size = max(16, 4 * run.training.accumulation)
        self.stepper = Stepper(
            run,
            stage,
            self.stage,
            self.updater,
            self.lock,
            stopped=lambda: self.queue.closed,
            invalidate=self._weights_changed,
            before_step=self._keep_weights,
            step_log=faults.log_steps,
            checkpoints=checkpoints,
        )
        self.times = ServiceTimes()
        self.device_name = device_name(device)
        self._thread = threading.Thread(target=self._loop, name=f"stage-{stage}-compute", daemon=True)
        self._thread.start()

    # -- submitting work -------------------------------------------------------------------

    def submit(self, work: ForwardWork | BackwardWork, active: Callable[[], bool] | None = None) -> Future:
        """Queue work; `active` tells whether the caller still waits (cancelled work is skipped)."""
        return self.queue.submit(work, active)

    def retract(self, microbatch_id: str, caller: str) -> int:
        """Take back the gradient that `caller`'s training call of `microbatch_id` added here, while the
        stage has not stepped with it; the samples it held. Raises `RequestError` when it cannot."""
        with self.lock:  # (no step runs while it is held: the step's own work runs under the step's hold)
            work = self.retractable.get(microbatch_id)
            if work is None:
                raise RequestError(
                    grpc.StatusCode.NOT_FOUND, f"microbatch_id: no gradient of {microbatch_id!r} is kept here"
                )
            if work.caller != caller:
                raise RequestError(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"microbatch_id: only the caller that sent {microbatch_id!r} may take back its gradient",
                )
            del self.retractable[microbatch_id]
            if microbatch_id not in self.stepper.pending_ids:
                raise RequestError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"microbatch_id: the gradient of {microbatch_id!r} is no longer pending here "
                    f"(the stage is at step {self.optimizer_steps})",
                )
            if isinstance(work, BackwardWork):
                negated = dataclasses.replace(work, output_grad=-work.output_grad)
            else:
                negated = dataclasses.replace(work, loss_scale=-work.loss_scale)
            task = Task(0, 0, negated, Future())
            staged = StagedGrads(self.stage)
            try:
                self._backward([task]) if isinstance(work, BackwardWork) else self._forward_loss([task])
            except BaseException:
                staged.drop()
                raise
            staged.commit()
            self.stepper.unserve(microbatch_id, task.samples)
            return task.samples

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
        return self.stepper.load_checkpoint(checkpoint)

    @property
    def optimizer_steps(self) -> int:
        """Global steps this stage's weights include."""
        return self.stepper.optimizer_steps

    @property
    def samples_served(self) -> int:
        """Samples whose gradients this worker accumulated."""
        return self.stepper.samples_served

    def time_use(self) -> str:
        """How the compute thread spent its time: serving work, and waiting for the stage's steps."""
        return (
            f"{self.busy_s:.1f} s serving, {self.stepper.waited_s:.1f} s waiting for steps, "
            f"{self.recomputed} samples' forwards recomputed in backward, "
            f"{self.stale_backwards} backward on the weights before a step"
        )

    def claim_cached(self, microbatch_id: str) -> CachedForward | None:
        """Take this microbatch's recorded forward, if it is still here and still usable."""
        return self.cache.claim(microbatch_id, self.weights_version)

    def _weights_now(self) -> WeightsAt:
        return WeightsAt([p for p in self.stage.parameters() if p.requires_grad])

    def _keep_weights(self) -> None:
        """Before the stage's step: copy the weights that delayed trainers' graphs still need (in the
        cache, or claimed by a backward that has not run yet)."""
        if self.weights.watched:
            self.weights.keep()

    def _weights_changed(self) -> None:
        self.weights_version += 1
        self.weights = self._weights_now()
        self.cache.keep_usable(self.weights_version)

    @property
    def throughput(self) -> float:
        """Samples per second of forward + backward, from moving averages of measured times."""
        return self.times.throughput

    def close(self) -> None:
        """Refuse queued work and stop. A step still averaging is left to time out on its own
        (the thread is a daemon): leaving must not wait for the stage's all-reduce."""
        self.queue.close()
        self._thread.join(timeout=1)
        self.stepper.close()

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
        # Gradient work stops at the global batch, so that the stages' steps line up (peer/stepper.py).
        room = self.stepper.room()
        if room == 0:  # the global batch is full here: its step comes before more gradient work
            self.stepper.maybe_step()
            room = self.stepper.room()
        got = self.queue.take(self.run.serve.max_batch_tokens, timeout=0.1, room=room)
        if got is None:
            self.stepper.maybe_step()  # the stage may have completed its batch on other peers
            if len(self.queue):
                time.sleep(0.01)  # what is queued waits for that step
            return
        kind, batch = got
        try:
            reachable = self.stepper.reachable(max(t.work.step for t in batch))
            for task in batch:
                if task.work.step > reachable:
                    resolve(task.future, error=self.stepper.ahead(task.work.step))
            batch = [t for t in batch if t.work.step <= reachable]
            if not batch:
                return
            self.stepper.catch_up(max(t.work.step for t in batch))
        except Exception as err:  # e.g. the stage's state could not be loaded: these callers retry elsewhere
            for task in batch:
                resolve(task.future, error=RequestError(grpc.StatusCode.UNAVAILABLE, f"stage sync failed: {err}"))
            raise
        self._run_batch(kind, batch)

    def _serve_aside(self) -> None:
        """Called by the stage's step while it waits for the other stages' gradient norms (peer/averaging.py
        NormExchange; on hivemind's optimizer thread, while the compute thread holds the lock and waits
        for that step, so the batch runs without taking the lock again): serve one batch of the training
        work queued for the steps taken and the one being taken, on the weights before it, its gradients
        set aside for the next step (peer/stepper.py Aside); else wait a moment. Without it, a stage that
        finished its global batch would sit idle until the slowest stage finished too, and a second
        trainer would add nothing. A forward that adds no gradient waits for the step: it may be a spot
        check (they look like training forwards), compared with another peer's answer computed on the
        exact weights the request names."""
        aside = self.stepper.stepping
        if aside is None:
            time.sleep(0.02)
            return

        def allow(work: ForwardWork | BackwardWork) -> bool:
            return work.step < aside.step or (work.step == aside.step and accumulates(work))

        got = self.queue.take(self.run.serve.max_batch_tokens, timeout=0.02, room=self.stepper.room(), allow=allow)
        if got is None:
            time.sleep(0.02)
            return
        self._run_batch(*got, locked=True)

    def _run_batch(self, kind: str, batch: list[Task], locked: bool = False) -> None:
        """`locked`: the lock is held for this batch already (`_serve_aside`)."""
        batch = still_waiting(batch)
        if not batch:
            return
        start = time.perf_counter()
        for task in batch:
            task.future.queue_s = start - task.enqueued  # read by the service, reported for routing
        try:
            with contextlib.nullcontext() if locked else self.lock:
                if accumulates(batch[0].work):
                    batch, results = self._accumulate(kind, batch)  # (delayed before its commit)
                elif kind == "backward":
                    results = self._backward(batch)  # a spot check's: no gradient kept
                else:
                    results = self._forward(batch)
            if not batch:
                return
            if not accumulates(batch[0].work):
                self.faults.delay(sum(t.samples for t in batch))
        except Exception as err:  # a real fault: report it to every caller in the batch
            for task in batch:
                resolve(task.future, error=err)
            return
        samples = sum(t.samples for t in batch)
        self.busy_s += time.perf_counter() - start
        self._measure(kind, batch, (time.perf_counter() - start) / samples)
        stage_step = self.stepper.stage_step
        for task, result in zip(batch, results, strict=True):
            task.future.stage_step = stage_step  # read by the service, the trainer's next step (peer/stepper.py)
            if isinstance(result, Exception):
                resolve(task.future, error=result)
            else:
                resolve(task.future, result=result)
        if self.stepper.stepping is None:  # (a batch served while a step waits is inside that step)
            self.stepper.maybe_step()  # after answering: the caller need not wait for the stage's step

    def _accumulate(self, kind: str, batch: list[Task]) -> tuple[list[Task], list]:
        """Run work that adds to the stage's gradient (backward; the last stage's training forward)
        and keep its gradient only for callers that still wait: those who gave up while it ran (the
        process was frozen, the call timed out or was cancelled) have retried elsewhere, and counting
        their microbatch here too would count it twice. The batch's gradient goes to fresh buffers
        first (`StagedGrads`); when some callers left, it is dropped and the rest is run again.

        A gradient that is not finite is dropped too, and its samples not counted: counted, they
        would complete the stage's global batch early, and the step would average fewer samples than
        it says. Its callers get an error and retry on another peer (one of a batch is run again alone
        first: another's gradient may be the one to blame). Returns the tasks kept and their results."""
        while batch:
            staged = StagedGrads(self.stage)
            try:
                results = self._backward(batch) if kind == "backward" else self._forward_loss(batch)
                self.faults.spoil(self.stage)
                # A slower device's stand-in takes its time before the commit, as the compute would.
                self.faults.delay(sum(t.samples for t in batch))
            except BaseException:
                staged.drop()
                raise
            if not grads_finite(self.stage):
                staged.drop()
                return self._non_finite(kind, batch)
            # The commit point, under the lock that commits: each caller must still wait now, and is
            # then promised its answer (`Task.claim`).
            left = [not task.claim() for task in batch]
            if not any(left):
                if self.stepper.stepping is not None:
                    staged.set_aside(self.stepper.stepping)  # for the step after the one that waits
                else:
                    staged.commit()
                served = [t for t, r in zip(batch, results, strict=True) if not isinstance(r, Exception)]
                self.stepper.served([t.work.microbatch_id for t in served], sum(t.samples for t in served))
                self._keep_for_retract(served)
                return batch, results
            staged.drop()
            for task, gone in zip(batch, left, strict=True):
                if gone:
                    gave_up(task)
            batch = [task.uncached() for task, gone in zip(batch, left, strict=True) if not gone]
        return [], []

    def _keep_for_retract(self, served: list[Task]) -> None:
        """Keep what `retract` needs to compute these tasks' gradients again: their requests, from the
        input alone (a recorded graph is spent). Under the lock."""
        for task in served:
            self.retractable[task.work.microbatch_id] = task.uncached().work
            self.retractable.move_to_end(task.work.microbatch_id)
        while len(self.retractable) > self.retractable_size:
            self.retractable.popitem(last=False)

    def _non_finite(self, kind: str, batch: list[Task]) -> tuple[list[Task], list]:
        """A batch whose gradient came out NaN or Inf: each of several is run again alone; one alone is refused."""
        if len(batch) > 1:
            kept, results = [], []
            for task in batch:
                k, r = self._accumulate(kind, [task.uncached()])
                kept += k
                results += r
            return kept, results
        log.warning(f"stage {self.stage_index}: dropped a non-finite gradient of {batch[0].samples} samples")
        # ABORTED, not INTERNAL (a fault of this server): the input may be what overflowed (a finite
        # 1e37 does) as well as this peer's weights, and either way the caller may ask another peer.
        why = "the gradient came out NaN or Inf (this input on this peer's weights); it was not kept"
        err = RequestError(grpc.StatusCode.ABORTED, why)
        resolve(batch[0].future, error=err)
        return [], []

    def _measure(self, kind: str, batch: list[Task], sec: float) -> None:
        if batch[0].work.check:
            return  # a spot check's answer is computed another way: it says little of the training calls
        # The last stage's training forward is forward + backward in one call.
        if kind == "forward" and batch[0].work.train and self.stage.is_last:
            sec /= 2
            self.times.observe("backward", sec)
        self.times.observe(kind, sec)

    def _lies(self, batch: list[Task]) -> list[bool]:
        """Which samples of the batch a test's dishonest peer corrupts (peer/options.py Faults)."""
        lying = self.faults.lies(self.run, self.stage_index, [t.work for t in batch])
        return [lie for task, lie in zip(batch, lying, strict=True) for _ in range(task.samples)]

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def _inputs(self, batch: list[Task]) -> torch.Tensor:
        """The batch's inputs, concatenated, on the device (float32 hidden states, or token ids)."""
        x = torch.cat([t.work.inputs for t in batch]) if len(batch) > 1 else batch[0].work.inputs
        x = self._to_device(x)
        # Detached: a leaf of its own for the input gradient, whatever the caller's tensor carries.
        return x if self.stage.is_first else x.float().detach()

    def _split(self, t: torch.Tensor | None, batch: list[Task]) -> list[torch.Tensor | None]:
        if t is None:
            return [None] * len(batch)
        return list(t.detach().to("cpu").split([task.samples for task in batch]))

    def _forward(self, batch: list[Task]) -> list[ForwardResult]:
        first: ForwardWork = batch[0].work
        if first.targets is not None:
            return self._forward_loss(batch)
        # Not while a step waits, but for a delayed trainer: the graph would be of the weights the
        # step is about to change, kept for delayed trainers' graphs only (`WeightsAt`).
        if first.train and self.cache.size > 0 and (self.stepper.stepping is None or self._keeps(first)):
            # Training forwards that came together are run one by one, each recording a graph of its
            # own: their backwards come one at a time, and a graph of the batch could only be spent
            # whole. A backward that recomputes runs the forward again, with grad; on a first stage
            # of small.toml on 2 cores that was a quarter of its compute, more than batching saves.
            return [self._recorded_forward(task) for task in batch]
        x = self._inputs(batch)
        with torch.no_grad(), autocast(self.device, self.run.model.dtype):
            out = self.faults.corrupt(self.stage(x), self._lies(batch))
        return [ForwardResult(output=o) for o in self._split(out, batch)]

    def _keeps(self, work: ForwardWork) -> bool:
        """A delayed trainer's forward whose graph can outlive the stage's step: the step copies the
        weights first. Not with activation checkpointing: backward would recompute the blocks on the
        weights of the moment."""
        return work.delayed and not self.run.model.checkpoint_activations

    def _recorded_forward(self, task: Task) -> ForwardResult:
        """A training forward whose graph is kept for its backward (`claim_cached`)."""
        x = self._inputs([task])
        weights, keeps = self.weights, self._keeps(task.work)
        # Only a delayed trainer's graph may be used once the weights changed: only its saved weights are watched.
        watch = weights.hooks() if keeps else contextlib.nullcontext()
        with torch.enable_grad(), autocast(self.device, self.run.model.dtype), watch:
            if not self.stage.is_first:
                x.requires_grad_(True)
            out = self.faults.corrupt(self.stage(x), self._lies([task]))
        entry = CachedForward(x, out, self.weights_version, weights, keeps)
        if keeps and self.stepper.stepping is not None:
            weights.keep()  # the step that waits copied none: there was no such graph when it began
        self.cache.put(task.work.microbatch_id, entry)
        return ForwardResult(output=out.detach().to("cpu"))

    def _forward_loss(self, batch: list[Task]) -> list[ForwardResult]:
        """Last stage with targets: the loss of each request and, when training, its input gradient;
        a spot check's (`check`) gets the same answer and keeps no gradient."""
        train, check = batch[0].work.train, batch[0].work.check
        x = self._inputs(batch)
        targets = self._to_device(torch.cat([t.work.targets for t in batch]))
        input_grad = (train or check) and not self.stage.is_first
        with torch.set_grad_enabled(train or input_grad):
            if input_grad:
                x.requires_grad_(True)
            with autocast(self.device, self.run.model.dtype):
                logits = self.faults.corrupt(self.stage(x), self._lies(batch))
            per_sample = F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none").mean(dim=1)
            sizes = [t.work.inputs.shape[0] for t in batch]
            losses = [chunk.mean() for chunk in per_sample.split(sizes)]
            if train or input_grad:
                total = sum(loss * t.work.loss_scale for loss, t in zip(losses, batch, strict=True))
                if train:
                    total.backward()
                else:
                    (x.grad,) = torch.autograd.grad(total, x)
        grads = self._split(x.grad if input_grad else None, batch)
        return [ForwardResult(loss=float(loss.detach()), input_grad=g) for loss, g in zip(losses, grads, strict=True)]

    def _backward(self, batch: list[Task]) -> list[torch.Tensor | None | Exception]:
        """Each task's input gradient; the weights' gradients accumulate, but for a spot check's (`check`)."""
        if batch[0].work.check:
            return self._input_grads(batch)
        results: list[torch.Tensor | None | Exception] = [None] * len(batch)
        recompute = []
        for i, task in enumerate(batch):
            cached = task.work.cached
            if cached is None or not usable(cached, self.weights_version):
                # A forward recorded before the stage's last step (another trainer's samples completed
                # a global batch in between) is recomputed on the weights the stage has now, as one
                # served by another peer is; a delayed trainer's runs on the weights it was recorded on.
                recompute.append(i)
            else:
                if cached.version != self.weights_version:
                    self.stale_backwards += task.samples
                cached.output.backward(self._to_device(task.work.output_grad).to(cached.output.dtype))
                results[i] = None if self.stage.is_first else cached.inputs.grad.detach().to("cpu")
        if recompute:
            sub = [batch[i].uncached() for i in recompute]
            self.recomputed += sum(t.samples for t in sub)
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

    def _input_grads(self, batch: list[Task]) -> list[torch.Tensor | None]:
        """A spot check's backward: the input gradient each task's training backward would give, and
        no gradient of the weights."""
        if self.stage.is_first:
            return [None] * len(batch)  # token ids have no gradient: nothing to compare
        results = []
        for task in batch:
            cached = task.work.cached
            if cached is not None and cached.version == self.weights_version:
                x, out = cached.inputs, cached.output
            else:
                x = self._inputs([task.uncached()]).requires_grad_(True)
                with torch.enable_grad(), autocast(self.device, self.run.model.dtype):
                    out = self.stage(x)
            grad = self._to_device(task.work.output_grad).to(out.dtype)
            (g,) = torch.autograd.grad(out, x, grad)
            results.append(g.detach().to("cpu"))
        return results

    # -- state -----------------------------------------------------------------------------

    @property
    def weights_step(self) -> int:
        """The step of the weights `named_tensors` reads: the stage's agreed ones (DiLoCo: the last
        outer step's, which every replica of the stage holds, not this replica's inner weights)."""
        return self.updater.agreed_step

    def named_tensors(self, with_grads: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The stage's agreed weights (`weights_step`) by name, and, `with_grads`, this replica's gradients."""
        with self.lock:
            params = {n: p.detach().to("cpu").clone() for n, p in self.stage.named_parameters()}
            agreed = self.updater.agreed_weights()
            if agreed is not None:
                trainable = [n for n, p in self.stage.named_parameters() if p.requires_grad]
                params.update(zip(trainable, agreed, strict=True))
            grads = {}
            if with_grads:
                grads = {
                    n: p.grad.detach().to("cpu").clone() for n, p in self.stage.named_parameters() if p.grad is not None
                }
        return params, grads
