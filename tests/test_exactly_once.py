"""Exactly-once, measured: a gradient is kept only while its caller still waits, checked at its
commit; dropped non-finite gradients count toward no step; and the benchmarks' "lost" counter
(benchmarks/ledger.py) comes out non-zero when gradients really die with a peer.

Real workers: in-process `StageWorker`s for the commit itself, and `swarm peer` processes on
loopback called over gRPC (by hand, or by a trainer through a coordinator's swarm).
"""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import Future
from pathlib import Path

import grpc
import pytest
import torch

from benchmarks.ledger import count
from peer.options import Faults
from peer.queue import Task
from peer.requests import ForwardWork
from peer.worker import StageWorker
from swarm.client import StageClient
from swarm.config import load_config
from swarm.rpc import method_path, pb
from swarm.wire import encode
from tests.conftest import CONFIGS
from tests.harness import ACCUMULATION, TINY, Swarm, peer_record
from tests.processes import member_client, start_peer

CONFIG = CONFIGS / "tiny.toml"
RUN = load_config(CONFIG)
T = RUN.training
SCALE = T.micro_batch / T.global_batch


def last_stage_work(name: str, seed: int) -> ForwardWork:
    """A training forward of the last stage (it adds to the stage's gradient), one microbatch."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T.micro_batch, 16, RUN.model.d_model, generator=g)
    y = torch.randint(0, RUN.model.vocab_size, (T.micro_batch, 16), generator=g)
    return ForwardWork(x, y, True, SCALE, name, 0)


def step_log(path: Path) -> list[list[str]]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line)["microbatches"] for line in lines]


def until(condition, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


# -- the commit ---------------------------------------------------------------------------------


def test_a_claimed_answer_cannot_be_cancelled_and_a_cancelled_one_cannot_be_claimed():
    promised = Task(0, 0, last_stage_work("a", 0), Future())
    assert promised.claim() and promised.claim()  # claimed once, still the caller's
    assert not promised.future.cancel(), "the service gave up on an answer whose gradient was kept"
    given_up = Task(0, 1, last_stage_work("b", 1), Future())
    assert given_up.future.cancel()
    assert not given_up.waiting() and not given_up.claim()
    gone = Task(0, 2, last_stage_work("c", 2), Future(), active=lambda: False)  # the gRPC call ended
    assert not gone.claim() and not gone.future.running()


def test_a_gradient_whose_request_the_service_gave_up_on_during_its_compute_is_not_kept():
    """The service stops waiting for a request after `serve.request_timeout_s` and cancels its
    future (its caller gets DEADLINE_EXCEEDED, and retries elsewhere), while the gRPC call itself is
    still live. The worker, slow (a test fault), is computing that request's gradient meanwhile: at
    its commit the gradient must be dropped, and the next request's kept alone."""
    worker = StageWorker(RUN, 1, torch.device("cpu"), faults=Faults(delay_per_sample=0.1))  # 0.8 s a microbatch
    try:
        gone = worker.submit(last_stage_work("gone", 0))  # no `active`: the call stays live throughout
        until(lambda: not len(worker.queue), "the compute thread did not take the work")
        time.sleep(0.2)
        assert gone.cancel()  # what the service's `_wait` does when it gives up
        kept = worker.submit(last_stage_work("kept", 1))
        kept.result(timeout=30)
        assert worker.stepper.pending_ids == ["kept"]
        assert worker.samples_served == T.micro_batch
    finally:
        worker.close()


def test_calls_that_expired_or_were_cancelled_while_their_gradient_was_computed_are_not_applied(processes, tmp_path):
    """A real stage worker (the last stage of tiny.toml, by hand, stepping every global batch) that
    takes 2 s per microbatch (a test fault standing in for a slow device), and a caller that gives
    up on two calls while the worker computes them: one by its deadline (1 s), one by cancelling its
    call. A trainer would have retried both elsewhere. Then two calls that wait. The worker's first
    optimizer step must hold the two that waited, and neither of the others."""
    steps = tmp_path / "steps.jsonl"
    proc, address = start_peer(CONFIG, 1, tmp_path, "--delay-per-sample", "0.25", "--log-steps", str(steps))
    client = StageClient(address, RUN, timeout=60)
    forward = client.channel.unary_unary(
        method_path("Forward"),
        request_serializer=pb.ForwardRequest.SerializeToString,
        response_deserializer=pb.ForwardResponse.FromString,
    )

    def request(name: str, seed: int) -> pb.ForwardRequest:
        work = last_stage_work(name, seed)
        return pb.ForwardRequest(
            run_id=RUN.run_id,
            stage=1,
            microbatch_id=name,
            input=encode(work.inputs),
            targets=encode(work.targets),
            train=True,
            step=0,
            loss_scale=SCALE,
        )

    try:
        with pytest.raises(grpc.RpcError) as expired:
            forward(request("expired", 0), timeout=1.0)
        assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        time.sleep(1.5)  # the worker finishes computing it: the next call finds it idle
        call = forward.future(request("cancelled", 1), timeout=60)
        time.sleep(0.7)  # taken into the compute (2 s) by now
        assert call.cancel()
        for seed, name in enumerate(("a", "b"), start=2):
            forward(request(name, seed), timeout=60)
        until(lambda: step_log(steps), "the worker took no step")
        assert step_log(steps)[0] == ["a", "b"]
    finally:
        client.close()
        proc.stop()
    assert proc.popen.returncode is not None


# -- non-finite gradients -----------------------------------------------------------------------


def test_a_peer_whose_gradients_come_out_non_finite_does_not_make_its_stage_step_early(processes, tmp_path):
    """A swarm of tiny.toml: a0 serves stage 0; b1 and n1 serve stage 1, and every weight gradient n1
    computes comes out NaN (a test fault; its answers stay finite, so the trainer takes them). n1
    must keep none of those samples: counted, they would complete stage 1's global batch early, and
    b1's step would average fewer samples than a global batch. So n1 applies no microbatch, every
    step b1 takes holds a whole global batch, and every microbatch sent reaches both stages."""
    swarm = Swarm(tmp_path)
    try:
        swarm.add_peer("a0", 0)
        swarm.add_peer("b1", 1)
        swarm.add_peer("n1", 1, "--non-finite-grads")
        swarm.wait_online(["a0", "b1", "n1"])
        steps = 6
        swarm.train(steps, 4, 20)
        records = swarm.finish_training()
        logs = swarm.applied()
    finally:
        swarm.close()
    applied_by = {name: [s["microbatches"] for s in logs if s["peer"] == name] for name in ("b1", "n1")}
    assert not [mb for step in applied_by["n1"] for mb in step], applied_by["n1"]
    settled = applied_by["b1"][: steps - 1]  # the last step may be cut short by the end of the run
    assert settled and all(len(ids) == ACCUMULATION for ids in settled), applied_by["b1"]
    ledger = count(records, logs, stages=2, tail=1)
    assert ledger.lost == 0 and ledger.applied_twice == 0, ledger.summary()
    assert "dropped a non-finite gradient" in (tmp_path / "n1.log").read_text()


# -- the lost counter ---------------------------------------------------------------------------


def test_gradients_that_die_with_a_killed_peer_are_counted_lost_and_none_before_it(processes, tmp_path):
    """A swarm of tiny.toml with a global batch of 8 microbatches: a0 serves stage 0, b1 and v1 stage 1.
    Mid-run, while v1 holds gradients of microbatches it served toward its stage's next step, its whole
    process group gets SIGKILL. The trainer had their answers and does not send them again, so their
    gradients died with v1: the ledger must count them lost. The steps settled before the kill lost
    nothing, and no microbatch was applied twice."""
    config = tmp_path / "wide.toml"
    config.write_text(TINY.read_text().replace("global_batch = 16", "global_batch = 64"))
    run = load_config(config)
    micro = run.training.micro_batch
    swarm = Swarm(tmp_path, config)
    try:
        for name, stage in (("a0", 0), ("b1", 1), ("v1", 1)):
            swarm.add_peer(name, stage)
        state = swarm.wait_online(["a0", "b1", "v1"])
        victim = member_client(swarm.url, run, peer_record(state, "v1"))
        steps = 8
        swarm.train(steps, 4, 20)
        swarm.wait_steps(3)  # steps settled before the kill, to count too
        victim_log = tmp_path / "v1.steps"

        def holds_gradients() -> bool:
            # v1's own counters (its Info), compared with its step log (written at each step): it served
            # samples that no step it logged holds. (Read from the coordinator's view, up to REFRESH_S +
            # its read interval old, the count had to be compared over steps of 256 samples.)
            info = victim.info()
            applied = step_log(victim_log)
            return len(applied) == info.optimizer_steps and info.samples_served > micro * sum(map(len, applied))

        until(holds_gradients, "v1 never held gradients toward a step", timeout=120)
        killed_after = len(swarm.records())
        swarm.peers["v1"].stop(signal.SIGKILL)
        victim.close()
        assert killed_after < steps - 1, "the kill came too late to count"
        records = swarm.finish_training()
        logs = swarm.applied()
    finally:
        swarm.close()
    # The trainer saw every microbatch through (the count the benchmarks used to call "lost" is 0) ...
    assert records[-1]["microbatches"] == steps * load_config(config).training.accumulation
    ledger = count(records, logs, stages=2)
    assert ledger.lost > 0, ledger.summary()  # ... yet gradients died with v1
    assert not ledger.missing[0], "stage 0 lost nothing: its only peer lived"
    before = count(records[: max(0, killed_after - 2)], logs, stages=2, tail=0)
    assert before.sent > 0 and before.lost == 0, before.summary()
    assert ledger.applied_twice == 0, ledger.summary()
