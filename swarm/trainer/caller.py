"""How the trainer reaches a stage: the `StageCaller` protocol that the training loop calls through.

A caller turns "run this on a worker of stage k" into a call to one worker: the static pipeline
(`--peers`: one fixed address per stage, swarm/trainer/pipeline.py), the swarm (routing, retries
and bans over the peers found in the DHT, swarm/trainer/swarm.py), or a caller that wraps another
one (spot checks of forward calls, swarm/trainer/spotcheck.py).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Protocol, TypeVar

import grpc
from tqdm import tqdm

from swarm.client import StageClient
from swarm.config import RunConfig
from swarm.rpc import pb

T = TypeVar("T")

# Codes that say "this request is wrong", not "this peer is unwell": from every peer of a stage, the
# trainer's own fault; from some, theirs.
REQUEST_FAULTS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED}

# `check(answer)`: raises `swarm.wire.WireError` naming what is wrong with a peer's answer (a wrong
# shape or dtype, NaN or Inf, bytes that do not decode) before the trainer uses it.
Check = Callable[[T], None]


class CallerClosed(Exception):
    """A call made after, or still going when, the caller was closed: the trainer is stopping."""


class RunFailed(Exception):
    """The run cannot go on, for a reason this trainer must fix (e.g. every peer of a stage refused its
    request as malformed): one line for the operator, no traceback."""


# `send(client, train, check=False)`: makes one forward call of a microbatch; a spot check sends it
# twice, the second time as a training forward (inner stages) or a `check` (the last stage).
ForwardSend = Callable[..., pb.ForwardResponse]
# `send(client, check)`: makes one Backward call of a microbatch (`check`: a spot check's answer).
BackwardSend = Callable[[StageClient, bool], pb.BackwardResponse]


class StageCaller(Protocol):
    run: RunConfig
    trace: str  # this trainer's id: its microbatch ids start with it

    @property
    def failures(self) -> int:
        """Calls that failed and were retried elsewhere."""
        ...

    def call(
        self,
        stage: int,
        samples: int,
        fn: Callable[[StageClient], T],
        prefer: str | None = None,
        check: Check | None = None,
    ) -> tuple[T, str]:
        """Run `fn` against a worker of `stage` (`prefer`: this worker first, when it can); returns its
        answer and which worker gave it. An answer that fails `check` is the worker's fault."""
        ...

    def forward(
        self,
        stage: int,
        samples: int,
        name: str,
        train: bool,
        send: ForwardSend,
        check: Check | None = None,
        mb_id: str = "",
        after: str | None = None,
    ) -> tuple[pb.ForwardResponse, str]:
        """One forward call of microbatch `name` (e.g. "12.3": step and index; `mb_id`: its id as the
        peers see it) to `stage`; `send` makes it; `after`: the worker of stage - 1 that served it."""
        ...

    def backward(
        self,
        stage: int,
        samples: int,
        name: str,
        send: BackwardSend,
        prefer: str | None = None,
        check: Check | None = None,
        mb_id: str = "",
    ) -> tuple[pb.BackwardResponse, str]:
        """One Backward call of microbatch `name` to `stage` (`prefer`: the worker that ran its forward)."""
        ...

    def served(self, stage: int, peer: str, samples: int) -> None:
        """`peer` of `stage` kept the gradient of `samples` samples: a receipt (swarm/receipts.py)."""
        ...

    def ceiling(self) -> int | None:
        """The furthest step the trainer may name next, whatever the stages' answers say: one past the
        swarm's step as most of its machines announce it (None: the answers are all there is)."""
        ...

    def host(self, stage: int, peer: str) -> str:
        """The machine of `stage`'s worker `peer` (as `call` names it): peers that share one say one thing."""
        ...

    def paused(self) -> bool:
        """Whether the operator paused the run: no new global step starts."""
        ...

    def bytes_on_wire(self) -> int: ...

    def counts(self) -> dict:
        """More counters for the `--log-json` lines and the summary (a swarm's spot checks)."""
        ...

    def close(self) -> None: ...


def event(text: str) -> None:
    """Something the operator may want to know, on its own line above the progress bar."""
    tqdm.write(text, file=sys.stderr)
