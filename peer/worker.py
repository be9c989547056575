"""A stage worker: one `Stage` on one device, fed by a queue, computed on its own thread.

Requests are decoded and checked in the gRPC threads (peer/service.py), then queued (peer/queue.py).
One compute thread (`StageWorker`) takes work in priority order (backward before forward, so
gradients drain and memory is freed first), batches concurrent requests of the same kind up to a token
budget, runs them, and hands results back. Encoding and decoding stay in the gRPC threads, so they
overlap with compute.

What a batch computes is the stage's module's business (peer/compute.py `StageCompute`, with the
forward graphs it keeps for their backward: peer/graphs.py); the gradients it adds to the stage's,
and takes back on its caller's word, are the `Accumulator`'s (peer/accumulator.py).

Optimizer steps (peer/stepper.py): each worker accumulates the gradients of the samples it served;
its `Stepper` takes the stage's steps, alone or averaged with the other peers of the stage, and
keeps the weights at the step each request names before the request runs.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import grpc
import torch

from peer.accumulator import Accumulator
from peer.checkpoint import Checkpoint, CheckpointWriter
from peer.compute import StageCompute
from peer.graphs import RecordedGraphs
from peer.options import NO_FAULTS, Faults
from peer.queue import Task, WorkQueue, accumulates, resolve, still_waiting
from peer.requests import BackwardWork, CachedForward, ForwardWork, RequestError
from peer.stepper import Stepper, make_updater
from swarm.config import RunConfig
from swarm.device import device_name
from swarm.model import Stage

log = logging.getLogger(__name__)


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
        self.lock = threading.Lock()  # held while parameters or gradients change
        self.graphs = RecordedGraphs(self.stage, run.serve.cache_size if cache_size is None else cache_size)
        self.stepper = Stepper(
            run,
            stage,
            self.stage,
            self.updater,
            self.lock,
            stopped=lambda: self.queue.closed,
            invalidate=self.graphs.changed,
            before_step=self.graphs.keep_weights,
            step_log=faults.log_steps,
            checkpoints=checkpoints,
        )
        self.compute = StageCompute(
            run, stage, self.stage, device, self.graphs, lambda: self.stepper.stepping is not None, faults
        )
        self.accumulator = Accumulator(run, self.compute, self.stepper, faults)
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
            return self.accumulator.retract(microbatch_id, caller)

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
            f"{self.compute.recomputed} samples' forwards recomputed in backward, "
            f"{self.compute.stale_backwards} backward on the weights before a step"
        )

    def claim_cached(self, microbatch_id: str) -> CachedForward | None:
        """Take this microbatch's recorded forward, if it is still here and still usable."""
        return self.graphs.claim(microbatch_id)

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
        """Called by the stage's step while it waits for the other stages' gradient norms (peer/norm_exchange.py
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
                    batch, results = self.accumulator.accumulate(kind, batch)  # (delayed before its commit)
                elif kind == "backward":
                    results = self.compute.backward(batch)  # a spot check's: no gradient kept
                else:
                    results = self.compute.forward(batch)
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

    def _measure(self, kind: str, batch: list[Task], sec: float) -> None:
        if batch[0].work.check:
            return  # a spot check's answer is computed another way: it says little of the training calls
        # The last stage's training forward is forward + backward in one call.
        if kind == "forward" and batch[0].work.train and self.stage.is_last:
            sec /= 2
            self.times.observe("backward", sec)
        self.times.observe(kind, sec)

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
