"""Fuzzing the stage service: hypothesis draws random and mutated requests (benchmarks/fuzz.py:
protobufs, shapes, dtypes, codecs, sizes, NaN and Inf, bytes) and sends them to two real stage
workers. Every answer is OK or a clean refusal, never a server fault; the workers live on and still
give the right answer to a good request. `SWARM_FUZZ_EXAMPLES` sets how many requests (default 250;
`python -m benchmarks fuzz` sends 10,000)."""

from __future__ import annotations

from concurrent import futures

import grpc

from benchmarks.fuzz import Call, StageFuzz, examples, fuzz_run, right_answer_gap, run_stage_fuzz, write_config
from swarm.config import load_config
from swarm.rpc import SERVICE
from tests.conftest import CONFIGS
from tests.harness import swarm_fixture
from tests.processes import start_peer

RUN = fuzz_run(load_config(CONFIGS / "tiny.toml"))
LAST = RUN.stages.count - 1
STAGES = {"first": 0, "last": LAST}


@swarm_fixture(scope="module")
def workers(tmp_path_factory):
    """Stage 0 and the last stage of tiny.toml (4 MB message limit), started side by side; yields
    {'first' | 'last': (proc, address)}."""
    tmp = tmp_path_factory.mktemp("fuzz")
    path = write_config(RUN, tmp)
    with futures.ThreadPoolExecutor(2) as pool:
        pending = {name: pool.submit(start_peer, path, stage, tmp) for name, stage in STAGES.items()}
    started, errors = {}, []
    for name, future in pending.items():
        try:
            started[name] = future.result()
        except Exception as err:  # stop the one that did start
            errors.append(err)
    try:
        if errors:
            raise errors[0]
        yield started
    finally:
        for proc, _ in started.values():
            proc.stop()


def test_fuzzed_requests_are_refused_cleanly_and_the_workers_still_serve_the_right_answer(workers):
    cases = examples(250)
    fuzz = StageFuzz(
        RUN, {name: (address, lambda p=proc: p.popen.poll() is None) for name, (proc, address) in workers.items()}
    )
    try:
        run_stage_fuzz(fuzz, cases, stop_at_failure=True)  # raises the first bad answer, shrunk
    finally:
        fuzz.close()
    assert fuzz.cases >= cases
    # The fuzz reached the workers' compute, not only their checks.
    assert fuzz.codes["OK"] >= cases // 20 and fuzz.codes["INVALID_ARGUMENT"] >= cases // 5, fuzz.codes
    for name, (proc, address) in workers.items():
        assert proc.popen.poll() is None, f"the {name} worker exited:\n{proc.output()[-3000:]}"
        # The weights it serves are finite, and a good Forward gets what they compute.
        assert right_answer_gap(RUN, address, STAGES[name]) <= 1e-4


def test_the_judge_calls_an_unhandled_exception_a_server_fault():
    """An answer of UNKNOWN (a handler that raised) or INTERNAL is a failure; a refusal is not."""

    def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
        if request == b"refuse":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "input: refused")
        if request == b"raise":
            raise ValueError("unhandled")
        return b""

    server = grpc.server(futures.ThreadPoolExecutor(2))
    handler = grpc.unary_unary_rpc_method_handler(handle)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Info": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    fuzz = StageFuzz(RUN, {"first": (f"127.0.0.1:{port}", lambda: True)})
    try:
        assert fuzz.failure(Call("first", "Info", b"")) is None
        assert fuzz.failure(Call("first", "Info", b"refuse")) is None
        assert fuzz.failure(Call("first", "Info", b"raise")).startswith("UNKNOWN")
    finally:
        fuzz.close()
        server.stop(0)
