"""The training loop over any `StageCaller`: microbatches driven hop by hop through the stages.

The trainer owns the data and drives each microbatch: forward through stages 0..S-1 (the last one
returns the loss and the gradient of its input), then backward in reverse. It keeps every stage's
input as the bytes it received, so a Backward call resends them as they were and no activation is
ever decoded or re-encoded here. K microbatches are in flight at once, so all stages work at the
same time. Workers take their optimizer step every global batch of samples; the trainer finishes a
global batch before it starts the next.

Steps are the swarm's: every answer says the step its stage reached (`stage_step`), and the trainer
names in its next microbatches the step all stages reached (`StageSteps`). Alone, that is its own
step + 1, so each of its global batches is one optimizer step; beside other trainers, whose samples
the stages count too, it jumps to the swarm's step, and names the step before it so as not to wait
for steps the others complete (`StageSteps.label`, peer/stepper.py). Its records' steps thus
increase, by one or more; `samples` says how many samples it trained itself.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from swarm.config import RunConfig
from swarm.data import Batch, DataExhausted, LocalShards, ShardSource, TrainStream, shards
from swarm.progress import RunLog, eval_due
from swarm.rpc import pb
from swarm.steps import majority_step
from swarm.tokenizer import load_tokenizer
from swarm.trainer.caller import StageCaller
from swarm.verify import new_key, opaque_id
from swarm.wire import WireError, encode, expect

PAUSE_CHECK_S = 1.0  # while the operator keeps the run paused, look again this often


class StageSteps:
    """The global step each stage said it reached (`stage_step`) in its answers to one step's
    microbatches; from them, the step of the trainer's next microbatches.

    A stage's word is what a majority of the machines that answered for it said (each machine: the
    highest step its peers said; `host(stage, peer)` names a peer's machine), as for the swarm's step
    (swarm/steps.py): a peer answering a huge step cannot send the trainer there (where honest peers
    would refuse its work: peer/stepper.py `reachable`). Peers that
    answered only before their stage's batch filled say a step less, so with replicas the word may
    lag: the trainer then names an older
    step, whose work the stages count toward their current one. When a liar gave all of a stage's
    answers of a step, the swarm's records still bound what the trainer names (`ceiling`)."""

    def __init__(
        self,
        stages: int,
        host: Callable[[int, str], str] = lambda stage, peer: peer,
        ceiling: Callable[[], int | None] = lambda: None,
    ):
        """`ceiling()`: the furthest step the swarm's records allow (StageCaller.ceiling)."""
        self.said: list[dict[str, int]] = [{} for _ in range(stages)]  # per stage: machine -> step
        self.host, self.ceiling = host, ceiling
        self.lock = threading.Lock()  # the microbatches' threads answer at once

    def heard(self, stage: int, peer: str, response: pb.ForwardResponse | pb.BackwardResponse) -> None:
        machine = self.host(stage, peer)
        with self.lock:
            said = self.said[stage]
            said[machine] = max(said.get(machine, 0), response.stage_step)

    @property
    def reached(self) -> list[int]:
        with self.lock:
            return [majority_step(said.values()) for said in self.said]

    def next_step(self, step: int) -> int:
        """The step after `step`: the one every stage reached with the samples it served, which is
        `step` + 1 when this trainer's samples were all the stages counted, and more when other
        trainers' samples took them further (never less: a peer too old to say counts as 0), up to
        the `ceiling` the swarm's records set (when a stage's every answer came from a liar)."""
        furthest = min(self.reached)
        ceiling = self.ceiling()
        if ceiling is not None:
            furthest = min(furthest, ceiling)
        return max(step + 1, furthest)

    def label(self, step: int) -> int:
        """The step to name in the microbatches of the step after `step` (`next_step`): that step
        itself while this trainer's samples were all the stages counted (its global batches are then
        the steps of synchronous training); when other trainers' samples took the stages further,
        the step before, which every stage has taken or is taking with its batch complete, so that
        no stage holds this trainer's work until the others' samples complete a step. Its gradients
        are then up to a step stale, as with hivemind's delayed parameter updates."""
        following = self.next_step(step)
        return following if following == step + 1 else following - 1


def microbatch(
    caller: StageCaller,
    batch: Batch,
    step: int,
    name: str,
    train: bool = True,
    steps: StageSteps | None = None,
    key: bytes | None = None,
    sent: list[str] | None = None,
    delayed: bool = False,
) -> float:
    """Forward (and, when training, backward) one microbatch through every stage; its loss. `steps`:
    told each stage's answers; `key`: the trainer's secret, with which the peers see the microbatch's
    name (e.g. "12.3": step and index) as an opaque id (None: as it is); `sent`: gets the
    microbatch's id before it is sent; `delayed`: the trainer runs with delayed updates, and says so
    in its training forwards (a stage may then take their backward on the weights they ran on)."""
    heard = steps.heard if steps is not None else lambda k, peer, response: None
    mb_id = f"{caller.trace}-{name if key is None else opaque_id(key, name)}"
    if sent is not None:
        sent.append(mb_id)
    last = caller.run.stages.count - 1
    samples = batch.inputs.shape[0]
    inputs: list[pb.Tensor] = [encode(batch.inputs)]
    served_by: list[str] = []
    # Every answer is checked before it is used or passed on (a bad one is blamed on the peer that
    # gave it and asked of another): hidden states and gradients of the input's shape, finite.
    hidden = (samples, batch.inputs.shape[1], caller.run.model.d_model)

    def output_ok(out: pb.ForwardResponse) -> None:
        expect(out.output, "output", hidden)

    def loss_ok(out: pb.ForwardResponse) -> None:
        if not math.isfinite(out.loss):
            raise WireError(f"loss: {out.loss} is not finite")
        if train and last > 0:
            expect(out.input_grad, "input_grad", hidden)

    def grad_ok(back: pb.BackwardResponse) -> None:
        expect(back.input_grad, "input_grad", hidden)

    for k in range(last):
        out, peer = caller.forward(
            k,
            samples,
            name,
            train,
            lambda c, t, k=k: c.forward(k, inputs[k], mb_id, step, train=t, delayed=delayed and t),
            output_ok,
            mb_id=mb_id,
            after=served_by[k - 1] if k else None,
        )
        heard(k, peer, out)
        inputs.append(out.output)
        served_by.append(peer)
    scale = samples / caller.run.training.global_batch
    targets = encode(batch.targets)
    out, peer = caller.forward(
        last,
        samples,
        name,
        train,
        lambda c, t, check=False: c.forward(
            last, inputs[last], mb_id, step, targets=targets, train=t, loss_scale=scale, check=check
        ),
        loss_ok,
        mb_id=mb_id,
        after=served_by[-1] if served_by else None,
    )
    heard(last, peer, out)
    if train:
        caller.served(last, peer, samples)
        grad = out.input_grad
        for k in range(last - 1, -1, -1):
            # The worker that ran the forward may still hold its graph: try it first.
            back, peer = caller.backward(
                k,
                samples,
                name,
                lambda c, check, k=k, g=grad: c.backward(k, inputs[k], g, mb_id, step, check=check),
                prefer=served_by[k],
                check=grad_ok if k > 0 else None,
                mb_id=mb_id,
            )
            heard(k, peer, back)
            caller.served(k, peer, samples)
            grad = back.input_grad
    return out.loss


def draw(data: TrainStream, count: int, size: int) -> list[Batch]:
    """The step's `count` microbatches of `size`; fewer when the stream runs dry mid-step: a trainer
    that leases its shards may have drawn every window of the shards it holds, and it gets the next
    one only once those are trained (the rest of its epoch is leased to other trainers)."""
    batches: list[Batch] = []
    for _ in range(count):
        try:
            batches.append(data.next_microbatch(size))
        except DataExhausted:
            if not batches:
                raise
            break
    return batches


def run_training(
    run: RunConfig,
    caller: StageCaller,
    progress: RunLog,
    steps: int,
    inflight: int,
    start: int = 0,
    on_step: Callable[[dict], None] | None = None,
    source: ShardSource | None = None,
    overlap: bool = False,
) -> list[dict]:
    """Train through `caller`, reporting to `progress`: one global batch per step, `inflight`
    microbatches at once; closes `caller` at the end. `on_step`: told each step's record too.
    `source`: where the shards come from (None: this trainer reads them all, LocalShards).

    While the operator keeps the run paused, no new step starts (the one in flight finishes).
    Steps are global: the loop trains `steps` global batches, the first at step `start` (a trainer
    joining a swarm starts at the swarm's step), each next one at the step the stages reached
    (`StageSteps`; alone: start .. start + steps - 1). Each microbatch's windows are reported
    trained to the data stream once its backward has come back. A validation pass after a step asks
    for the weights of the next one.

    `overlap` (delayed parameter updates, as SWARM's): a step's microbatches are sent while the
    previous step's are still in flight, as soon as one of the `inflight` slots frees, instead of
    after the previous step's last backward. They name the step the previous one named, so no stage
    holds them until it has stepped: a stage serves them on the weights it has, before or after its
    step (a gradient up to one step stale), and counts their gradients toward its next step (it
    stops a step's gradient work at the global batch, peer/stepper.py). The stages never wait for
    the trainer between two steps, nor the first stage for the last one's backward."""
    t = run.training
    source = source if source is not None else LocalShards(shards(run.data), t.seed)
    data = TrainStream(run.data, run.model.seq_len, t.seed, load_tokenizer(run.data.tokenizer), source)
    val = data.val_batches(t.eval_batches, t.micro_batch)
    desc = progress.bar.desc  # the bar's own description, shown again when a pause ends
    # With overlap, the pool holds two steps' microbatches; `inflight` threads send them in order.
    pool = ThreadPoolExecutor(max_workers=inflight, thread_name_prefix="microbatch")
    done = samples = 0
    step = label = start
    key = new_key()  # the microbatches' ids say nothing a peer could use to tell checked calls

    def send(step: int) -> tuple:
        if caller.paused():
            progress.note("paused by the operator")
            while caller.paused():
                time.sleep(PAUSE_CHECK_S)
            progress.note(desc)
        batches = draw(data, t.accumulation, t.micro_batch)
        reached = StageSteps(run.stages.count, caller.host, caller.ceiling)
        sent: list[str] = []  # the ids of this step's microbatches, for its record (benchmarks/ledger.py)
        jobs = [
            pool.submit(microbatch, caller, b, label, f"{step}.{j}", steps=reached, key=key, sent=sent, delayed=overlap)
            for j, b in enumerate(batches)
        ]
        return step, batches, jobs, reached, sent

    def finish(i: int, step: int, batches: list[Batch], jobs: list, reached: StageSteps, sent: list[str]) -> int:
        """Wait for step `step`'s microbatches, record it (and validate when due); the next step."""
        nonlocal done, samples, label
        losses = []
        for batch, job in zip(batches, jobs, strict=True):
            losses.append(job.result())
            data.trained(batch)
            progress.trained(step, batch.ids)
        loss = sum(losses) / len(losses)
        done += len(jobs)
        samples += sum(b.inputs.shape[0] for b in batches)
        following, label = reached.next_step(step), reached.label(step)
        val_loss = None
        if eval_due(i, steps, t.eval_every):
            evals = [
                pool.submit(microbatch, caller, b, following, f"val{step}.{j}", False, key=key)
                for j, b in enumerate(val)
            ]
            val_loss = sum(j.result() for j in evals) / len(evals)
        record = progress.step(
            step,
            loss,
            sum(b.inputs.numel() for b in batches),
            val_loss,
            wire_bytes=caller.bytes_on_wire(),
            microbatches=done,
            samples=samples,
            failures=caller.failures,
            microbatch_ids=sent,
            **caller.counts(),
        )
        if on_step:
            on_step(record)
        return following

    try:
        in_flight = None  # overlap: the step sent and not yet finished
        for i in range(steps):
            if not overlap:
                step = finish(i, *send(step))
                continue
            # Its number: one past the step in flight (the stages' word on it comes when it ends).
            sending = send(step if in_flight is None else in_flight[0] + 1)
            if in_flight is not None:
                step = finish(i - 1, *in_flight)
            in_flight = sending
        if in_flight is not None:
            step = finish(steps - 1, *in_flight)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        wire = caller.bytes_on_wire()
        caller.close()
    tokens = max(progress.tokens, 1)
    progress.close(
        codec=run.wire.codec,
        **{
            "wire bytes": f"{wire:,} ({wire / tokens:,.0f} per token)",
            "microbatches": f"{done:,}",
            "failed calls retried": caller.failures,
            **{k.replace("_", " "): v for k, v in caller.counts().items()},
        },
    )
    return progress.records
