"""The stage worker's queue: requests waiting for the compute thread, taken in batches.

Two FIFO lanes, backward before forward, so that gradients drain and memory is freed first. A
batch is work of one kind and one shape (`batch_key`) that fits a token budget: concurrent
requests of the same kind run as one, and each caller gets its own slice of the result.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import grpc

from peer.requests import BackwardWork, ForwardWork, RequestError


@dataclass(order=True)
class Task:
    """One request's work, the future its caller waits on, and whether that caller still waits."""

    priority: int
    seq: int
    work: ForwardWork | BackwardWork = field(compare=False)
    future: Future = field(compare=False)
    active: Callable[[], bool] | None = field(default=None, compare=False)  # False once the caller gave up
    enqueued: float = field(default_factory=time.perf_counter, compare=False)

    def waiting(self) -> bool:
        """Whether the caller still waits for the answer: its call is live (`active`), and the service
        has not given up on the future (a request that waited longer than `serve.request_timeout_s`)."""
        return not self.future.cancelled() and (self.active is None or self.active())

    def claim(self) -> bool:
        """At the commit of this task's gradient: whether its caller still waits, and if so promise it
        the answer. The future is marked running, so the service can no longer cancel it (and answer
        the caller DEADLINE_EXCEEDED) after the gradient was kept: a cancel either comes first and
        the gradient is dropped, or fails and the caller gets its answer (peer/service.py `_wait`)."""
        if not self.waiting():
            return False
        return self.future.running() or self.future.set_running_or_notify_cancel()

    def uncached(self) -> Task:
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


def batch_key(work: ForwardWork | BackwardWork) -> tuple:
    """Work with equal keys can run as one batch: same kind, shape, dtype and mode."""
    if isinstance(work, ForwardWork):
        shape = tuple(work.inputs.shape[1:])
        return ("forward", shape, work.inputs.dtype, work.targets is not None, work.train, work.check)
    return ("backward", work.input_shape[1:], work.output_grad.dtype, work.cached is None, work.check)


def accumulates(work: ForwardWork | BackwardWork) -> bool:
    """Work that adds to the stage's gradient: a backward, or the last stage's training forward (a
    spot check's answer of either keeps none)."""
    if isinstance(work, BackwardWork):
        return not work.check
    return work.train and work.targets is not None


def resolve(future: Future, result=None, error: BaseException | None = None) -> None:
    """Hand a result to a caller that may have given up meanwhile (its future is then cancelled)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


def gave_up(task: Task) -> None:
    """Answer a caller that left: its work was not done, or was undone."""
    resolve(task.future, error=RequestError(grpc.StatusCode.CANCELLED, "the caller gave up"))


def still_waiting(batch: list[Task]) -> list[Task]:
    """The tasks whose callers still wait; the others are answered CANCELLED. A caller that timed out
    has retried elsewhere: doing its work now would count its gradient twice."""
    kept = []
    for task in batch:
        if task.waiting():
            kept.append(task)
        else:
            gave_up(task)
    return kept


class WorkQueue:
    """Two FIFO lanes; backward first. `take` returns a batch of tasks of one kind and one shape."""

    def __init__(self):
        self.lanes: dict[str, collections.deque] = {"backward": collections.deque(), "forward": collections.deque()}
        self.cond = threading.Condition()
        self.closed = False
        self._seq = itertools.count()

    def submit(self, work: ForwardWork | BackwardWork, active: Callable[[], bool] | None = None) -> Future:
        """Queue work; `active` tells whether the caller still waits (cancelled work is skipped)."""
        kind = "backward" if isinstance(work, BackwardWork) else "forward"
        future: Future = Future()
        self.put(kind, Task(0 if kind == "backward" else 1, next(self._seq), work, future, active))
        return future

    def put(self, kind: str, task: Task) -> None:
        with self.cond:
            self.lanes[kind].append(task)
            self.cond.notify()

    def __len__(self) -> int:
        return sum(map(len, self.lanes.values()))

    def take(
        self,
        budget: int,
        timeout: float = 0.5,
        room: int | None = None,
        allow: Callable[[ForwardWork | BackwardWork], bool] | None = None,
    ) -> tuple[str, list[Task]] | None:
        """`budget`: tokens of a batch; `room`: samples of a batch of work that `accumulates` (the first
        task is taken whatever its size; with no room, 0, such work stays queued); `allow`: only work
        it accepts (the rest stays queued, in order, and does not hold up what may be taken). None comes
        back when nothing queued may be taken."""
        with self.cond:
            if not self.cond.wait_for(lambda: len(self) or self.closed, timeout) or self.closed:
                return None

            def eligible(work: ForwardWork | BackwardWork) -> bool:
                return (allow is None or allow(work)) and (room != 0 or not accumulates(work))

            for kind in ("backward", "forward"):
                lane = self.lanes[kind]
                # The first task that may be taken: one that may not waits without holding up the rest.
                at = next((i for i, task in enumerate(lane) if eligible(task.work)), None)
                if at is None:
                    continue
                first = lane[at]
                del lane[at]
                batch, tokens, samples = [first], first.tokens, first.samples
                key = batch_key(first.work)
                limit = room if room is not None and accumulates(first.work) else None
                # Take the ones right after it of the same kind and shape while they fit the token budget
                # (and the room).
                while at < len(lane) and batch_key(lane[at].work) == key and tokens + lane[at].tokens <= budget:
                    if limit is not None and samples + lane[at].samples > limit:
                        break
                    if not eligible(lane[at].work):
                        break
                    task = lane[at]
                    del lane[at]
                    batch.append(task)
                    tokens += task.tokens
                    samples += task.samples
                return kind, batch
            return None

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
            for lane in self.lanes.values():
                while lane:
                    resolve(lane.popleft().future, error=RuntimeError("the worker is shutting down"))
