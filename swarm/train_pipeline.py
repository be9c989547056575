"""Training through stage workers over the network: a static pipeline, one worker per stage.

The trainer owns the data and drives each microbatch hop by hop: forward through stages
0..S-1 (the last one returns the loss and the gradient of its input), then backward in reverse.
It keeps every stage's input as the bytes it received, so a Backward call resends them as they
were and no activation is ever decoded or re-encoded here. K microbatches are in flight at once,
so all stages work at the same time. Workers take their optimizer step every global batch of
samples; the trainer finishes a global batch before it starts the next.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import grpc

from swarm.client import StageClient
from swarm.config import ConfigError, RunConfig
from swarm.data import Batch, TokenStream
from swarm.progress import RunLog, eval_due
from swarm.rpc import pb
from swarm.wire import encode

T = TypeVar("T")

PAUSE_CHECK_S = 1.0  # while the operator keeps the run paused, look again this often


class Pipeline:
    """A static pipeline: one worker per stage, given by address and checked against the run config."""

    failures = 0  # calls that failed and were retried elsewhere (a static pipeline has no elsewhere)
    note: Callable[[str], None] = staticmethod(lambda text: None)  # a status line next to the progress bar

    def __init__(self, run: RunConfig, addresses: list[str], timeout: float = 120.0, join_token: str | None = None):
        """`join_token`: sent with every call, for workers that require one."""
        if len(addresses) != run.stages.count:
            raise ConfigError(f"--peers: {len(addresses)} addresses for a run of {run.stages.count} stages")
        self.run, self.num_stages = run, run.stages.count
        self.clients = [StageClient(a, run, timeout, join_token=join_token) for a in addresses]
        self.trace = uuid.uuid4().hex[:12]
        for k, client in enumerate(self.clients):
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
            if info.run_id != run.run_id:
                problems.append(f"serves run {info.run_id!r}, not {run.run_id!r}")
            if info.stage != k:
                problems.append(f"serves stage {info.stage}, listed as stage {k}")
            if info.model_hash != run.model_hash():
                problems.append("has a different model or stage split (model hash)")
            if problems:
                raise ConfigError(f"--peers: {client.address}: " + "; ".join(problems))

    num_stages: int

    def paused(self) -> bool:
        """Whether the operator paused the run (a static pipeline has no operator)."""
        return False

    def call(
        self, stage: int, samples: int, fn: Callable[[StageClient], T], prefer: str | None = None
    ) -> tuple[T, str]:
        """Run `fn` against a worker of `stage`; returns its answer and which worker gave it."""
        return fn(self.clients[stage]), str(stage)

    def forward(
        self, stage: int, samples: int, name: str, train: bool, send: Callable[[StageClient, bool], pb.ForwardResponse]
    ) -> tuple[pb.ForwardResponse, str]:
        """One forward call of microbatch `name` to `stage`; `send(client, train)` makes it."""
        return self.call(stage, samples, lambda c: send(c, train))

    def microbatch(self, batch: Batch, step: int, name: str, train: bool = True) -> float:
        """Forward (and, when training, backward) one microbatch through every stage; its loss."""
        mb_id = f"{self.trace}-{name}"
        last = self.num_stages - 1
        samples = batch.inputs.shape[0]
        inputs: list[pb.Tensor] = [encode(batch.inputs)]
        served_by: list[str] = []
        for k in range(last):
            out, peer = self.forward(
                k, samples, name, train, lambda c, t, k=k: c.forward(k, inputs[k], mb_id, step, train=t)
            )
            inputs.append(out.output)
            served_by.append(peer)
        scale = samples / self.run.training.global_batch
        targets = encode(batch.targets)
        out, _ = self.forward(
            last,
            samples,
            name,
            train,
            lambda c, t: c.forward(last, inputs[last], mb_id, step, targets=targets, train=t, loss_scale=scale),
        )
        if train:
            grad = out.input_grad
            for k in range(last - 1, -1, -1):
                # The worker that ran the forward may still hold its graph: try it first.
                back, _ = self.call(
                    k, samples, lambda c, k=k, g=grad: c.backward(k, inputs[k], g, mb_id, step), prefer=served_by[k]
                )
                grad = back.input_grad
        return out.loss

    def bytes_on_wire(self) -> int:
        return sum(c.bytes_sent + c.bytes_received for c in self.clients)

    def counts(self) -> dict:
        """More counters for the `--log-json` lines and the summary (a swarm's spot checks)."""
        return {}

    def close(self) -> None:
        for c in self.clients:
            c.close()


def train_pipeline(
    run: RunConfig, addresses: list[str], steps: int, inflight: int = 4, log_json=None, join_token: str | None = None
) -> list[dict]:
    pipe = Pipeline(run, addresses, join_token=join_token)
    return run_training(
        run, pipe, steps, inflight, log_json, f"train ({run.stages.count} stages, {inflight} in flight)"
    )


def run_training(
    run: RunConfig,
    pipe: Pipeline,
    steps: int,
    inflight: int,
    log_json,
    desc: str,
    on_step: Callable[[dict], None] | None = None,
    start: int = 0,
) -> list[dict]:
    """The training loop over any pipeline: one global batch per step, `inflight` microbatches at once.

    While the operator keeps the run paused, no new step starts (the one in flight finishes).
    Steps are global: the loop runs steps start .. start + steps - 1 (a trainer joining a swarm
    starts at the swarm's step), and data order follows the global step. A validation pass after
    step s asks for the weights after s + 1 steps."""
    t = run.training
    data = TokenStream.from_config(run.data, run.model.seq_len, t.seed)
    val = data.val_batches(t.eval_batches, t.micro_batch)
    log = RunLog(steps, log_json, desc=desc)
    pipe.note = log.note
    pool = ThreadPoolExecutor(max_workers=inflight, thread_name_prefix="microbatch")
    tokens_per_step = t.global_batch * run.model.seq_len
    done = 0
    try:
        for i in range(steps):
            step = start + i
            if pipe.paused():
                pipe.note("paused by the operator")
                while pipe.paused():
                    time.sleep(PAUSE_CHECK_S)
                pipe.note(desc)
            jobs = [
                pool.submit(pipe.microbatch, data.microbatch(step, i, t.micro_batch), step, f"{step}.{i}")
                for i in range(t.accumulation)
            ]
            loss = sum(j.result() for j in jobs) / len(jobs)
            done += len(jobs)
            val_loss = None
            if eval_due(i, steps, t.eval_every):
                jobs = [pool.submit(pipe.microbatch, b, step + 1, f"val{step}.{j}", False) for j, b in enumerate(val)]
                val_loss = sum(j.result() for j in jobs) / len(jobs)
            record = log.step(
                step,
                loss,
                tokens_per_step,
                val_loss,
                wire_bytes=pipe.bytes_on_wire(),
                microbatches=done,
                failures=pipe.failures,
                **pipe.counts(),
            )
            if on_step:
                on_step(record)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        wire = pipe.bytes_on_wire()
        pipe.close()
    tokens = max(log.tokens, 1)
    log.close(
        codec=run.wire.codec,
        **{
            "wire bytes": f"{wire:,} ({wire / tokens:,.0f} per token)",
            "microbatches": f"{done:,}",
            "failed calls retried": pipe.failures,
            **{k.replace("_", " "): v for k, v in pipe.counts().items()},
        },
    )
    return log.records
