"""Training through a static pipeline: `swarm train --peers ADDR0,ADDR1,...`, one worker per stage.

The workers are given by address, in stage order, and checked against the run config before the
first call; every call of a stage goes to its one worker, and a failed call or a bad answer ends the
run (there is no other worker to retry on).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import grpc

from swarm.client import StageClient
from swarm.config import ConfigError, RunConfig
from swarm.progress import RunLog
from swarm.rpc import pb
from swarm.trainer.caller import REQUEST_FAULTS, BackwardSend, Check, ForwardSend, RunFailed, T
from swarm.trainer.loop import run_training
from swarm.trainer.options import TrainerOptions
from swarm.wire import WireError


class StaticCaller:
    """A `StageCaller` with one fixed worker per stage."""

    def __init__(self, run: RunConfig, addresses: list[str], timeout: float = 120.0, join_token: str | None = None):
        """`join_token`: sent with every call, for workers that require one."""
        if len(addresses) != run.stages.count:
            raise ConfigError(f"--peers: {len(addresses)} addresses for a run of {run.stages.count} stages")
        self.run = run
        self.trace = uuid.uuid4().hex[:12]
        self.failures = 0  # never retried: a static pipeline has no other worker
        self.clients = [StageClient(a, run, timeout, join_token=join_token) for a in addresses]
        for k, client in enumerate(self.clients):
            self._check(k, client)

    def _check(self, stage: int, client: StageClient) -> None:
        """The worker answers, and serves this run's `stage` of the same model."""
        try:
            info = client.info()
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise ConfigError(
                    f"--peers: {client.address} refused the call: give the run's join token with --join-token "
                    "(or $SWARM_JOIN_TOKEN)"
                ) from None
            raise ConfigError(f"--peers: {client.address} does not answer ({err.code().name})") from None
        problems = []
        if info.run_id != self.run.run_id:
            problems.append(f"serves run {info.run_id!r}, not {self.run.run_id!r}")
        if info.stage != stage:
            problems.append(f"serves stage {info.stage}, listed as stage {stage}")
        if info.model_hash != self.run.model_hash():
            problems.append("has a different model or stage split (model hash)")
        if problems:
            raise ConfigError(f"--peers: {client.address}: " + "; ".join(problems))

    def call(
        self,
        stage: int,
        samples: int,
        fn: Callable[[StageClient], T],
        prefer: str | None = None,
        check: Check | None = None,
    ) -> tuple[T, str]:
        client = self.clients[stage]
        try:
            answer = fn(client)
            if check is not None:
                check(answer)
        except grpc.RpcError as err:
            if err.code() in REQUEST_FAULTS:
                raise RunFailed(f"stage {stage} worker {client.address} refused the request: {err.details()}") from None
            raise
        except WireError as err:
            raise RunFailed(f"stage {stage} worker {client.address} gave a bad answer: {err}") from None
        return answer, str(stage)

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
        return self.call(stage, samples, lambda c: send(c, train), check=check)  # (one worker a stage)

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
        return self.call(stage, samples, lambda c: send(c, False), check=check)  # (no one to take it back from)

    def served(self, stage: int, peer: str, samples: int) -> None:
        pass  # one worker per stage, nobody to average with: no receipts

    def ceiling(self) -> int | None:
        return None  # no records: its workers' answers are all it has

    def host(self, stage: int, peer: str) -> str:
        return peer  # one worker per stage

    def paused(self) -> bool:
        return False  # a static pipeline has no operator

    def bytes_on_wire(self) -> int:
        return sum(c.bytes_sent + c.bytes_received for c in self.clients)

    def counts(self) -> dict:
        return {}

    def close(self) -> None:
        for c in self.clients:
            c.close()


def train_pipeline(run: RunConfig, addresses: list[str], opts: TrainerOptions) -> list[dict]:
    """Train through the workers at `addresses` (one per stage, in stage order); the per-step records."""
    caller = StaticCaller(run, addresses, join_token=opts.join_token)
    steps = opts.steps or run.training.steps
    desc = f"train ({run.stages.count} stages, {opts.inflight} in flight)"
    progress = RunLog(steps, opts.log_json, desc=desc, log_windows=opts.log_windows)
    return run_training(run, caller, progress, steps, opts.inflight, overlap=opts.delayed_updates)
