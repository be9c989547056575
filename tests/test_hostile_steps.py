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

For each: the honest trainer takes every step, 0 .. STEPS - 1 in order, and no honest stage moved: the
step each announces is at most the trainer's last, its step log counts its steps one by one, and it
never skipped one.
"""

from __future__ import annotations

from pathlib import Path

from tests.harness import Swarm
from tests.processes import child, wait_for_output, wait_for_state
from tests.test_hostile_checks import assert_every_step_done

FAR = 2**31 - 2
HUGE = 10**9
STEPS = 4


def assert_no_stage_moved(swarm: Swarm, tmp: Path, names: list[str]) -> None:
    """The honest peers `names` took the trainer's steps and no more: each announces at most STEPS,
    its step log counts one step at a time (a skip to a far step shows as a gap, or as a step beyond
    STEPS; a replica that took a step's result from its partner instead begins its log one later), and
    its log names no skipped step."""
    state = wait_for_state(swarm.url, lambda s: True)
    announced = {p["public_name"]: p["optimizer_steps"] for s in state["stages"] for p in s["peers"]}
    assert all(announced[name] <= STEPS for name in names), announced
    for name in names:
        taken = [step["step"] for step in swarm.applied() if step["peer"] == name]
        first = taken[0] if taken else 1
        assert taken == list(range(first, first + len(taken))), (name, taken)
        assert all(step <= STEPS for step in taken), (name, taken)
        log = (tmp / f"{name}.log").read_text()
        assert "skipped step" not in log, log[-3000:]


def test_a_trainer_naming_a_far_step_is_refused_and_moves_no_stage(processes, tmp_path):
    """The hostile trainer starts once the honest one has taken 2 steps and keeps asking: every call
    refused. Without the refusal its first call took each stage to step 2^31 - 2."""
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
        wait_for_output(hostile, r"failed \(FAILED_PRECONDITION\)", timeout=120)
        assert_every_step_done(swarm, STEPS)
        assert hostile.popen.poll() is None, hostile.output()[-3000:]  # still trying: every call refused
        assert_no_stage_moved(swarm, tmp_path, names)
    finally:
        if hostile is not None:
            hostile.stop()
        swarm.close()


def test_members_claiming_a_huge_step_in_every_stage_do_not_move_the_trainer(processes, tmp_path):
    """The trainer starts at the swarm's step, 0, and goes on one step at a time, whatever the liars'
    records and answers say. With the largest claim taken as the swarm's step it started at 10^9."""
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
        swarm.train(STEPS, 4, 20)
        # It starts at the swarm's step, 0: its progress bar names no other (a trainer sent to 10^9 waits
        # there for stages that never reach it).
        start = wait_for_output(swarm.trainer, r"train \([^)]*\)( from step \d+)?:", timeout=120)
        assert start.group(1) is None, start.group(0)
        assert_every_step_done(swarm, STEPS)
        assert_no_stage_moved(swarm, tmp_path, names)
    finally:
        swarm.close()
