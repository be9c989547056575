"""A DHT call's result pipe crosses to the DHT's process once per calling process (swarm/dht_calls.py)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.reduction

import pytest
from hivemind.utils import get_dht_time

from swarm.dht_calls import _future
from swarm.records import started_dht


def test_a_processs_dht_calls_send_its_result_pipe_once_and_a_forked_process_sends_its_own(processes, monkeypatch):
    """20 calls from this process hand one file descriptor to the DHT's process (hivemind's handed
    one per call: this process's result pipe); a process forked with the DHT object hands over its
    own pipe with its first call, and each gets its own results."""
    dht = started_dht()
    try:
        passed: list[int] = []  # descriptors pickled for another process (a Connection is pickled as one)
        dupfd = multiprocessing.reduction.DupFd
        monkeypatch.setattr(multiprocessing.reduction, "DupFd", lambda fd: (passed.append(fd), dupfd(fd))[1])
        assert dht.store("key", "value", get_dht_time() + 600)
        assert [dht.get("key").value for _ in range(19)] == ["value"] * 19
        assert len(passed) == 1, f"{len(passed)} descriptors handed over in 20 calls"

        fork = multiprocessing.get_context("fork")
        results = fork.Queue()

        def child() -> None:
            before = len(passed)
            values = [dht.get("key").value for _ in range(5)]
            results.put((values, len(passed) - before))

        forked = fork.Process(target=child)
        forked.start()
        values, handed = results.get(timeout=60)
        forked.join(timeout=30)
        assert values == ["value"] * 5
        assert handed == 1, f"the forked process handed over {handed} descriptors in 5 calls"
        assert dht.get("key").value == "value"  # this process's pipe is still the one its results take
        assert len(passed) == 1
    finally:
        dht.shutdown()


def test_a_call_from_a_process_whose_pipe_never_arrived_is_refused_with_the_reason():
    with pytest.raises(RuntimeError, match="whose first call never arrived"):
        _future({"_origin_pid": -1}, None)
