"""The step a trainer names in its next microbatches (swarm/trainer/loop.py StageSteps), from the
steps the stages said they reached in their answers."""

from swarm.rpc import pb
from swarm.trainer.loop import StageSteps


def heard(reached: list[int]) -> StageSteps:
    steps = StageSteps(len(reached))
    for stage, step in enumerate(reached):
        steps.heard(stage, pb.ForwardResponse(stage_step=max(step - 1, 0)))  # an earlier answer of the step
        steps.heard(stage, pb.ForwardResponse(stage_step=step))
    return steps


def test_alone_a_trainer_names_the_step_after_its_own():
    steps = heard([8, 8, 8])
    assert steps.next_step(7) == 8 and steps.label(7) == 8  # the weights after its own batch: synchronous


def test_a_stage_too_old_to_say_never_takes_a_trainer_back():
    steps = heard([0, 9])
    assert steps.next_step(7) == 8 and steps.label(7) == 8


def test_beside_other_trainers_it_names_the_step_before_the_one_the_stages_reached():
    steps = heard([11, 10, 12])
    # The others' samples took every stage past this trainer's own step: it moves to step 10, but
    # names step 9, which every stage has taken or is taking with its batch complete, so that no
    # stage holds its work until the others complete step 10.
    assert steps.next_step(7) == 10 and steps.label(7) == 9
