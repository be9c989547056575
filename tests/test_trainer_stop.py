"""A trainer stops when told, whatever it is doing: SIGINT (Ctrl-C) or SIGTERM to its main process
ends it, its DHT node with it, within 10 s, even while it waits for a stage that has no peer.
Real processes: a coordinator, one peer (stage 0 of 2), a trainer."""

from __future__ import annotations

import signal
import time

import pytest

from swarm.children import survivors
from tests.harness import Swarm

STOP_S = 10.0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_trainer_waiting_for_a_stage_with_no_peer_stops_within_10_s(processes, tmp_path, sig):
    swarm = Swarm(tmp_path)
    try:
        swarm.add_peer("p0", 0)
        swarm.wait_online(["p0"])
        trainer = swarm.train(5)
        deadline = time.monotonic() + 90
        while "waiting for a peer of stage 1" not in trainer.output():
            assert trainer.alive() and time.monotonic() < deadline, trainer.output()[-3000:]
            time.sleep(0.2)
        time.sleep(1.0)  # well inside the wait: its microbatch threads are looping on the empty stage
        sent = time.monotonic()
        trainer.popen.send_signal(sig)  # the main process only: the trainer must end its children itself
        code = trainer.popen.wait(STOP_S + 5)
        took = time.monotonic() - sent
        left = survivors(trainer.popen.pid, timeout=max(0.0, STOP_S - took))
        print(f"{sig.name}: exit {code} after {took:.1f} s; left over: {left}")
        assert took <= STOP_S and code == 130, trainer.output()[-3000:]
        assert left == [], left
        assert "Traceback" not in trainer.output()
    finally:
        swarm.close()
