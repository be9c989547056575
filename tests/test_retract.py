"""A spot check's second answer keeps no gradient, and a training call's gradient can be taken back.

The trainer compares a peer's training answers (the last stage's loss and input gradient, a
Backward's input gradient) with a second peer's answer to the same request sent as a `check`:
computed the same way, with no gradient kept. When its spot checks outvote a training answer, the
trainer takes that call's gradient back (`Retract`) and has the microbatch redone elsewhere.

Real in-process `StageWorker`s of tiny.toml cut into three stages (stage 1 is an inner stage whose
Backward has an input gradient), and one over gRPC for the caller check.
"""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from peer.requests import BackwardWork, ForwardWork, RequestError
from peer.worker import StageWorker
from swarm.config import load_config
from tests.conftest import CONFIGS

TINY = load_config(CONFIGS / "tiny.toml").with_stages(3)
# A global batch of 4 microbatches: the tests' few calls stay pending (until the last test fills it).
BATCH = 4 * TINY.training.micro_batch
RUN = TINY.model_copy(update={"training": TINY.training.model_copy(update={"global_batch": BATCH})})
T = RUN.training
SCALE = T.micro_batch / T.global_batch
D, V = RUN.model.d_model, RUN.model.vocab_size
ME = "ipv4:127.0.0.1"


def data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states, targets and an output gradient of one microbatch."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T.micro_batch, 16, D, generator=g)
    y = torch.randint(0, V, (T.micro_batch, 16), generator=g)
    return x, y, torch.randn(T.micro_batch, 16, D, generator=g) * 1e-3


def grads(worker: StageWorker) -> torch.Tensor:
    """The stage's accumulated gradient, flattened (zeros where none)."""
    _, named = worker.named_tensors(with_grads=True)
    params, _ = worker.named_tensors(with_grads=False)
    return torch.cat([named.get(n, torch.zeros_like(p)).flatten() for n, p in params.items()])


def close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-5) -> bool:
    return float((a - b).norm()) <= rtol * max(float(a.norm()), float(b.norm()), 1e-12)


@pytest.fixture
def last():
    worker = StageWorker(RUN, 2, torch.device("cpu"))
    yield worker
    worker.close()


@pytest.fixture
def inner():
    worker = StageWorker(RUN, 1, torch.device("cpu"))
    yield worker
    worker.close()


def forward(worker: StageWorker, seed: int, name: str, train: bool = True, check: bool = False):
    x, y, _ = data(seed)
    work = ForwardWork(x, y, train, SCALE, name, 0, check=check, caller=ME)
    return worker.submit(work).result(timeout=60)


def backward(worker: StageWorker, seed: int, name: str, check: bool = False):
    x, _, g = data(seed)
    return worker.submit(BackwardWork(x, g, name, 0, tuple(x.shape), check=check, caller=ME)).result(timeout=60)


def test_a_last_stage_check_answers_as_the_training_forward_would_and_keeps_no_gradient(last):
    checked = forward(last, 0, "m", train=False, check=True)
    assert last.samples_served == 0 and float(grads(last).abs().sum()) == 0.0, "a check kept a gradient"
    assert checked.input_grad is not None and checked.input_grad.shape == (T.micro_batch, 16, D)
    trained = forward(last, 0, "m")
    assert last.samples_served == T.micro_batch and float(grads(last).abs().sum()) > 0
    assert abs(checked.loss - trained.loss) <= 1e-6 * abs(trained.loss)
    assert close(checked.input_grad, trained.input_grad)
    evaluated = forward(last, 0, "e", train=False)  # an evaluation forward: the loss, nothing else
    assert evaluated.input_grad is None and abs(evaluated.loss - trained.loss) <= 1e-6 * abs(trained.loss)


def test_a_backward_check_answers_as_the_training_backward_would_and_keeps_no_gradient(inner):
    checked = backward(inner, 1, "m", check=True)
    assert inner.samples_served == 0 and float(grads(inner).abs().sum()) == 0.0, "a check kept a gradient"
    trained = backward(inner, 1, "m")
    assert inner.samples_served == T.micro_batch and float(grads(inner).abs().sum()) > 0
    assert close(checked, trained)


@pytest.mark.parametrize("stage", ["last", "inner"])
def test_a_retracted_gradient_leaves_the_stage_as_if_it_was_never_served(stage, request):
    worker: StageWorker = request.getfixturevalue(stage)
    call = forward if stage == "last" else backward
    call(worker, 2, "kept")
    alone = grads(worker)
    call(worker, 3, "outvoted")
    assert worker.samples_served == 2 * T.micro_batch and not close(grads(worker), alone)
    assert worker.retract("outvoted", ME) == T.micro_batch
    assert worker.samples_served == T.micro_batch and worker.stepper.pending_ids == ["kept"]
    assert close(grads(worker), alone, rtol=1e-5), "the retracted gradient is still in the stage's"
    with pytest.raises(RequestError) as again:  # taken back once
        worker.retract("outvoted", ME)
    assert again.value.code == grpc.StatusCode.NOT_FOUND and "no gradient of 'outvoted'" in again.value.message


def test_only_the_caller_of_a_training_call_may_take_its_gradient_back(last):
    forward(last, 4, "theirs")
    with pytest.raises(RequestError) as refused:
        last.retract("theirs", "ipv4:10.0.0.9")
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert "only the caller that sent 'theirs'" in refused.value.message
    assert last.samples_served == T.micro_batch  # still kept
    assert last.retract("theirs", ME) == T.micro_batch


def test_a_gradient_the_stage_stepped_with_cannot_be_taken_back(last):
    for i in range(T.accumulation):  # a whole global batch: the stage steps with it
        forward(last, 10 + i, f"s.{i}")
    deadline = time.monotonic() + 30
    while last.optimizer_steps < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert last.optimizer_steps == 1
    with pytest.raises(RequestError) as late:
        last.retract("s.0", ME)
    assert late.value.code == grpc.StatusCode.FAILED_PRECONDITION and "no longer pending" in late.value.message
