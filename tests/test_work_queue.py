"""The stage worker's queue: backward first, batches of one kind and shape within the token budget."""

import torch

from peer.requests import BackwardWork, ForwardWork
from peer.worker import StageWorker, WorkQueue, _Task
from swarm.config import load_config
from tests.conftest import CONFIGS


def fwd(b: int, t: int = 16, train: bool = False) -> ForwardWork:
    return ForwardWork(torch.zeros(b, t, 8), None, train, 0.0, "f", 0)


def bwd(b: int, t: int = 16) -> BackwardWork:
    return BackwardWork(torch.zeros(b, t, 8), torch.zeros(b, t, 8), "b", 0, (b, t, 8))


def put(q: WorkQueue, work, seq: int) -> _Task:
    from concurrent.futures import Future

    kind = "backward" if isinstance(work, BackwardWork) else "forward"
    task = _Task(0 if kind == "backward" else 1, seq, work, Future())
    q.put(kind, task)
    return task


def test_backward_is_served_before_forward():
    q = WorkQueue()
    put(q, fwd(2), 0)
    put(q, bwd(2), 1)
    kind, batch = q.take(budget=10_000)
    assert kind == "backward" and len(batch) == 1
    kind, batch = q.take(budget=10_000)
    assert kind == "forward"


def test_concurrent_requests_are_batched_up_to_the_token_budget():
    q = WorkQueue()
    tasks = [put(q, fwd(2), i) for i in range(5)]  # 32 tokens each
    kind, batch = q.take(budget=100)
    assert batch == tasks[:3]  # 96 tokens fit, a fourth would not
    kind, batch = q.take(budget=100)
    assert batch == tasks[3:]


def test_requests_of_another_shape_or_mode_are_not_mixed():
    q = WorkQueue()
    a = put(q, fwd(2, t=16), 0)
    b = put(q, fwd(2, t=8), 1)
    c = put(q, fwd(2, t=8, train=True), 2)
    assert q.take(budget=10_000)[1] == [a]
    assert q.take(budget=10_000)[1] == [b]
    assert q.take(budget=10_000)[1] == [c]
    assert q.take(budget=10_000, timeout=0.05) is None


def test_closing_fails_waiting_requests():
    q = WorkQueue()
    task = put(q, fwd(1), 0)
    q.close()
    assert isinstance(task.future.exception(timeout=1), RuntimeError)


def test_batched_forwards_give_each_request_its_own_result():
    run = load_config(CONFIGS / "tiny.toml")
    worker = StageWorker(run, 1, torch.device("cpu"))
    try:
        xs = [torch.randn(b, 16, run.model.d_model) for b in (1, 2, 3)]
        worker.lock.acquire()  # hold the compute thread so the three requests queue up together
        futures = [worker.submit(ForwardWork(x, None, False, 0.0, f"m{i}", 0)) for i, x in enumerate(xs)]
        worker.lock.release()
        outs = [f.result(timeout=30).output for f in futures]
        with torch.no_grad():
            for x, out in zip(xs, outs, strict=True):
                assert torch.allclose(out, worker.stage(x), atol=1e-5)
    finally:
        worker.close()
