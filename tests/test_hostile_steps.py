"""Hostile insiders against the swarm's step count, with real processes (a coordinator, peers each on
a loopback address of its own, trainers).

- A trainer names a step far ahead in its requests (2^31 - 2, the most a request may name). A stage
  used to skip to it: its step count and learning rate jumped to the end of the schedule, and every
  later trainer started there. Now a peer refuses work for a step beyond one past both its own and
  what a majority of the swarm's machines announce (peer/stepper.py `reachable`).
- Members say their stage took a huge number of steps, in their records and in every answer, one in
  every stage. A joining trainer used to start at the largest step a stage announced, and a trainer
  went on to the largest step a stage's answers said; the stages then skipped to it. Now the swarm's
  step is what a majority of its machines announce (swarm/steps.py), and a stage's answers count
  once per machine too (swarm/trainer/loop.py `StageSteps`).

For each: every step of the honest trainer completes and the final validation loss is at most 3%
above the reference trainer's (tests/test_hostile_checks.py), and no honest stage skipped a step.
"""

from __future__ import annotations

import time

from tests.processes import child, wait_for_state
from tests.test_hostile_checks import STEPS, assert_trained_like_the_reference
from tests.test_swarm import Swarm

FAR = 2**31 - 2
HUGE = 10**9


def honest_steps(swarm: Swarm, names: list[str]) -> dict[str, int]:
    state = wait_for_state(swarm.url, lambda s: True)
    return {
        p["public_name"]: p["optimizer_steps"] for s in state["stages"] for p in s["peers"] if p["public_name"] in names
    }


def assert_no_step_skipped(swarm: Swarm, tmp, names: list[str]) -> None:
    for name in names:
        log = (tmp / f"{name}.log").read_text()
        assert "skipped step" not in log, log[-3000:]


def test_a_trainer_naming_a_far_step_is_refused_and_moves_no_stage(processes, tmp_path):
    swarm = Swarm(tmp_path)
    hostile = None
    try:
        names = ["p0", "p1"]
        swarm.add_peer("p0", 0)
        swarm.add_peer("p1", 1)
        swarm.wait_online(names)
        swarm.train(STEPS, 4, 20)
        swarm.wait_steps(2)
        hostile = child(
            ["train", "--coordinator", swarm.url, "--steps", "2", "--start-step", str(FAR), "--call-timeout", "5"],
            tmp_path / "hostile.log",
        )
        records = assert_trained_like_the_reference(swarm)
        assert [r["step"] for r in records] == list(range(STEPS))
        out = hostile.output()
        assert hostile.popen.poll() is None, out[-3000:]  # still trying: every call refused
        assert "failed (FAILED_PRECONDITION)" in out, out[-3000:]
        steps = honest_steps(swarm, names)
        assert all(s <= STEPS for s in steps.values()), steps
        assert_no_step_skipped(swarm, tmp_path, names)
    finally:
        if hostile is not None:
            hostile.stop()
        swarm.close()


def test_members_claiming_a_huge_step_in_every_stage_do_not_move_the_trainer(processes, tmp_path):
    swarm = Swarm(tmp_path)
    try:
        names = ["a", "b"]
        swarm.add_peer("a", 0)
        swarm.add_peer("x", 0, "--host", "127.0.0.98", "--claim-steps", str(HUGE))
        swarm.add_peer("b", 1)
        swarm.add_peer("y", 1, "--host", "127.0.0.99", "--claim-steps", str(HUGE))
        state = swarm.wait_online(["a", "x", "b", "y"])
        claimed = {p["public_name"]: p["optimizer_steps"] for s in state["stages"] for p in s["peers"]}
        assert claimed["x"] == claimed["y"] == HUGE  # the lie is on the record
        started = time.monotonic()
        swarm.train(STEPS, 4, 20)
        records = assert_trained_like_the_reference(swarm)
        assert [r["step"] for r in records] == list(range(STEPS)), records[:2]
        assert "from step" not in swarm.trainer.output()  # it started at the swarm's step, 0
        steps = honest_steps(swarm, names)
        assert all(s <= STEPS for s in steps.values()), steps
        assert_no_step_skipped(swarm, tmp_path, names)
        print(f"trained {STEPS} steps beside the liars in {time.monotonic() - started:.0f} s")
    finally:
        swarm.close()
