"""The stage worker's queue: backward first, batches of one kind and shape within the token budget."""

import torch

from peer.queue import Task, WorkQueue
from peer.requests import BackwardWork, ForwardWork
from peer.worker import StageWorker
from swarm.config import load_config
from tests.conftest import CONFIGS


def fwd(b: int, t: int = 16, train: bool = False, step: int = 0) -> ForwardWork:
    return ForwardWork(torch.zeros(b, t, 8), None, train, 0.0, "f", step)


def bwd(b: int, t: int = 16, step: int = 0) -> BackwardWork:
    return BackwardWork(torch.zeros(b, t, 8), torch.zeros(b, t, 8), "b", step, (b, t, 8))


def put(q: WorkQueue, work, seq: int) -> Task:
    from concurrent.futures import Future

    kind = "backward" if isinstance(work, BackwardWork) else "forward"
    task = Task(0 if kind == "backward" else 1, seq, work, Future())
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


def test_gradient_work_is_batched_up_to_the_room_left_in_the_global_batch():
    # Two trainers' backwards at once: a batch that took them all would carry the stage past its global
    # batch, and its step n would no longer hold the samples the other stages' step n holds.
    q = WorkQueue()
    tasks = [put(q, bwd(8), i) for i in range(4)]
    assert q.take(budget=10_000, room=16)[1] == tasks[:2]
    assert q.take(budget=10_000, room=4)[1] == tasks[2:3]  # the first task is taken whatever its size
    forwards = [put(q, fwd(8), i) for i in range(4, 7)]  # evaluation work adds no gradient: no room to keep
    assert q.take(budget=10_000, room=8)[1] == [tasks[3]]
    assert q.take(budget=10_000, room=8)[1] == forwards


def test_only_work_allowed_is_taken_and_work_not_allowed_holds_up_nothing():
    # E.g. work of the steps taken only: the backward lane holds step 5, the forward lane begins with it.
    q = WorkQueue()
    later = put(q, bwd(8, step=5), 0)
    forwards = [put(q, fwd(8, step=s), i) for i, s in ((1, 5), (2, 4), (3, 3))]
    taken = lambda work: work.step <= 4  # noqa: E731
    assert q.take(budget=10_000, allow=taken)[1] == forwards[1:]
    assert q.take(budget=10_000, timeout=0.01, allow=taken) is None
    assert q.take(budget=10_000)[1] == [later]
    assert q.take(budget=10_000)[1] == [forwards[0]]


def test_with_the_global_batch_full_gradient_work_stays_queued():
    q = WorkQueue()
    backward = put(q, bwd(8), 0)
    evaluation = put(q, fwd(8), 1)
    assert q.take(budget=10_000, room=0)[1] == [evaluation]  # adds no gradient
    assert q.take(budget=10_000, timeout=0.01, room=0) is None
    assert q.take(budget=10_000, room=8)[1] == [backward]


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


def twin_first_stages(run) -> tuple[StageWorker, StageWorker]:
    """A first-stage worker and a reference worker with the same weights."""
    worker = StageWorker(run, 0, torch.device("cpu"))
    reference = StageWorker(run, 0, torch.device("cpu"))
    reference.stage.load_state_dict(worker.stage.state_dict())
    return worker, reference


def first_stage_work(run, names: str, seed: int) -> tuple[dict, dict]:
    """Token ids and output gradients of a first-stage microbatch of 2 x 16 per name."""
    torch.manual_seed(seed)
    tokens = {k: torch.randint(0, run.model.vocab_size, (2, 16)) for k in names}
    grad = {k: torch.randn(2, 16, run.model.d_model) for k in names}
    return tokens, grad


def test_training_forwards_that_came_together_each_keep_their_graph_for_their_backward():
    """Three training forwards of the first stage, queued together and taken as one batch: each keeps a
    graph of its own, its backward runs on that graph (nothing recomputed), and the stage's gradient is
    the one the three would give served one by one."""
    run = load_config(CONFIGS / "tiny.toml")
    worker, reference = twin_first_stages(run)
    try:
        tokens, grad = first_stage_work(run, "abc", 2)
        worker.lock.acquire()  # hold the compute thread so the three requests queue up together
        futures = {k: worker.submit(ForwardWork(tokens[k], None, True, 0.0, k, 0)) for k in "abc"}
        worker.lock.release()
        outs = {k: f.result(timeout=30).output for k, f in futures.items()}
        cached = {k: worker.claim_cached(k) for k in "abc"}
        assert all(cached.values()), cached
        for k in "abc":
            backward = BackwardWork(None, grad[k], k, 0, (2, 16), cached=cached[k])
            assert worker.submit(backward).result(timeout=30) is None  # the first stage has no input gradient
            assert torch.allclose(outs[k], reference.stage(tokens[k]), atol=1e-5)
            reference.stage(tokens[k]).backward(grad[k])
        assert worker.stepper.pending_ids == list("abc")
        assert_same_grads(worker.stage, reference.stage, atol=1e-5)
    finally:
        worker.close()
        reference.close()


def leaves_during_compute():
    """An `active` callable of a caller that waits when its work is taken and has left by the time
    the work is done (its call timed out, or the worker's process was frozen meanwhile)."""
    answers = iter([True])
    return lambda: next(answers, False)


def grads_of(stage: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}


def assert_same_grads(stage: torch.nn.Module, reference: torch.nn.Module, atol: float) -> None:
    got, want = grads_of(stage), grads_of(reference)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.allclose(got[name], want[name], atol=atol), name


def test_a_gradient_whose_caller_left_during_the_compute_is_not_kept():
    """The last stage's training forward of two callers, batched; one leaves while it runs. Only the
    other's gradient is kept (as if it had come alone) and only its samples count as served."""
    from concurrent.futures import Future

    import grpc
    import torch.nn.functional as F

    from peer.requests import RequestError

    run = load_config(CONFIGS / "tiny.toml")
    worker = StageWorker(run, 1, torch.device("cpu"))
    try:
        torch.manual_seed(0)
        x = {k: torch.randn(2, 16, run.model.d_model) for k in "ab"}
        y = {k: torch.randint(0, run.model.vocab_size, (2, 16)) for k in "ab"}
        reference = StageWorker(run, 1, torch.device("cpu"))  # same seeded init, served alone
        reference.stage.load_state_dict(worker.stage.state_dict())
        worker.lock.acquire()  # queue both, so that they are batched
        stays: Future = worker.submit(ForwardWork(x["a"], y["a"], True, 0.5, "a", 0))
        leaves: Future = worker.submit(ForwardWork(x["b"], y["b"], True, 0.5, "b", 0), leaves_during_compute())
        worker.lock.release()
        result = stays.result(timeout=30)
        err = leaves.exception(timeout=30)
        assert isinstance(err, RequestError) and err.code == grpc.StatusCode.CANCELLED
        assert worker.samples_served == 2 and worker.stepper.pending_ids == ["a"]

        xa = x["a"].clone().requires_grad_(True)
        logits = reference.stage(xa)
        loss = F.cross_entropy(logits.transpose(1, 2), y["a"], reduction="none").mean(dim=1).mean()
        (loss * 0.5).backward()
        reference.close()
        assert abs(result.loss - loss.item()) < 1e-5
        assert torch.allclose(result.input_grad, xa.grad, atol=1e-6)
        assert_same_grads(worker.stage, reference.stage, atol=1e-6)
    finally:
        worker.close()


def test_a_recorded_forward_whose_partner_left_is_run_again_from_its_input():
    """Two backwards of recorded forwards (first stage), batched; one caller leaves during the
    compute. The other's graph is spent by then: it is recomputed from its recorded input, and the
    stage's gradient is the stayer's alone, added to what was accumulated before."""
    run = load_config(CONFIGS / "tiny.toml")
    worker, reference = twin_first_stages(run)
    try:
        tokens, grad = first_stage_work(run, "pab", 1)
        # Something accumulated before, which must stay.
        worker.submit(BackwardWork(tokens["p"], grad["p"], "p", 0, (2, 16))).result(timeout=30)
        for k in "ab":
            worker.submit(ForwardWork(tokens[k], None, True, 0.0, k, 0)).result(timeout=30)
        cached = {k: worker.claim_cached(k) for k in "ab"}
        assert all(cached.values())
        worker.lock.acquire()
        stays = worker.submit(BackwardWork(None, grad["a"], "a", 0, (2, 16), cached=cached["a"]))
        leaves = worker.submit(
            BackwardWork(None, grad["b"], "b", 0, (2, 16), cached=cached["b"]), leaves_during_compute()
        )
        worker.lock.release()
        assert stays.result(timeout=30) is None  # the first stage has no input gradient
        assert leaves.exception(timeout=30) is not None
        assert worker.stepper.pending_ids == ["p", "a"]

        for k in "pa":
            reference.stage(tokens[k]).backward(grad[k])
        assert_same_grads(worker.stage, reference.stage, atol=1e-5)
    finally:
        worker.close()
        reference.close()


def test_a_recorded_forward_from_before_the_stages_state_was_loaded_is_run_again_on_the_loaded_weights():
    """Between a training forward and its backward, the replica found its weights differ from its
    stage's and loaded the stage's state in place (`resync`), at the same step count. The recorded
    graph holds the replaced weights: the backward is recomputed from the recorded input on the loaded
    weights. It used to run the old graph, and the peer answered with a server fault (a weight had
    been modified in place) and a traceback in its log."""
    run = load_config(CONFIGS / "tiny.toml")
    worker = StageWorker(run, 0, torch.device("cpu"))
    stage_state = StageWorker(run, 0, torch.device("cpu"))  # what the stage's other replicas hold
    try:
        torch.manual_seed(2)
        with torch.no_grad():
            for p in stage_state.stage.parameters():
                p.add_(0.01 * torch.randn_like(p))

        def load_state() -> str:  # as hivemind's download does: copied into the parameters in place
            with torch.no_grad():
                for p, q in zip(worker.stage.parameters(), stage_state.stage.parameters(), strict=True):
                    p.copy_(q)
            return "the stage's replicas"

        worker.updater.load_state = load_state
        tokens, grad = torch.randint(0, run.model.vocab_size, (2, 16)), torch.randn(2, 16, run.model.d_model)
        worker.submit(ForwardWork(tokens, None, True, 0.0, "a", 0)).result(timeout=30)
        cached = worker.claim_cached("a")  # the backward's request arrived ...
        assert cached is not None
        worker.stepper.resync()  # ... and the state was loaded before it ran
        assert worker.optimizer_steps == 0
        assert worker.submit(BackwardWork(None, grad, "a", 0, (2, 16), cached=cached)).result(timeout=30) is None
        stage_state.stage(tokens).backward(grad)
        assert_same_grads(worker.stage, stage_state.stage, atol=1e-5)
    finally:
        worker.close()
        stage_state.close()


def test_a_lost_step_is_waited_for_once_then_the_stage_keeps_the_trainers_step_count():
    """The peers that served step 0 died with its gradients: the first request of step 1 waits
    `sync_timeout_s` for the stage's count, then the stage skips step 0. Steps 1, 2 and 3 then find
    their predecessor's samples here and never wait again; the stage's step count stays the trainer's
    global step (so its gradient-norm exchange and averaging use the other stages' step numbers)."""
    import time

    run = load_config(CONFIGS / "tiny.toml")
    wait_s = 3.0
    run = run.model_copy(update={"averaging": run.averaging.model_copy(update={"sync_timeout_s": wait_s})})
    t = run.training
    worker = StageWorker(run, 1, torch.device("cpu"))
    try:
        torch.manual_seed(0)
        waited = {}
        for step in (1, 2, 3):
            for i in range(t.accumulation):
                x = torch.randn(t.micro_batch, 16, run.model.d_model)
                y = torch.randint(0, run.model.vocab_size, (t.micro_batch, 16))
                work = ForwardWork(x, y, True, t.micro_batch / t.global_batch, f"{step}.{i}", step)
                start = time.monotonic()
                worker.submit(work).result(timeout=60)
                if i == 0:
                    waited[step] = time.monotonic() - start
            # the step's samples are all here: the stage takes step `step` on its own (or on the next request)
        assert worker.stepper.skipped_steps == [range(0, 1)]
        assert waited[1] >= wait_s
        # No later first request waits for a count: each finds its predecessor's samples at hand
        # (seconds below the wait even on a loaded machine: a tiny forward takes milliseconds).
        assert waited[2] < wait_s and waited[3] < wait_s, waited
        deadline = time.monotonic() + 30
        while worker.optimizer_steps < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.optimizer_steps == 4  # step 0 skipped, steps 1..3 applied: the trainer's count
    finally:
        worker.close()
