"""The step a trainer names in its next microbatches (swarm/trainer/loop.py StageSteps), from the
steps the stages said they reached in their answers."""

from swarm.rpc import pb
from swarm.trainer.loop import StageSteps


def heard(reached: list[int]) -> StageSteps:
    steps = StageSteps(len(reached))
    for stage, step in enumerate(reached):
        steps.heard(stage, "p", pb.ForwardResponse(stage_step=max(step - 1, 0)))  # an earlier answer of the step
        steps.heard(stage, "p", pb.ForwardResponse(stage_step=step))
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


def test_a_peer_answering_a_huge_step_does_not_send_the_trainer_there():
    """A stage's word is a majority of the machines that answered for it: one liar beside one honest
    machine, or two ids of the liar's on one machine, is not a majority."""
    hosts = {"honest": "10.0.0.1", "liar": "10.0.0.2", "sybil": "10.0.0.2", "other": "10.0.0.3"}
    steps = StageSteps(2, lambda stage, peer: hosts[peer])
    for stage in (0, 1):
        steps.heard(stage, "honest", pb.BackwardResponse(stage_step=8))
        steps.heard(stage, "liar", pb.BackwardResponse(stage_step=10**9))
        steps.heard(stage, "sybil", pb.BackwardResponse(stage_step=10**9))
    assert steps.reached == [8, 8]
    assert steps.next_step(7) == 8 and steps.label(7) == 8
    # A majority of machines is the stage's word, and a liar alone in a stage is all that stage says;
    # but the trainer goes by the stage that reached least.
    steps.heard(0, "other", pb.BackwardResponse(stage_step=10**9))
    assert steps.next_step(7) == 8


def test_the_swarms_records_bound_the_step_when_a_liar_gave_all_of_a_stages_answers():
    steps = StageSteps(2, ceiling=lambda: 9)  # most machines announce step 8
    steps.heard(0, "liar", pb.BackwardResponse(stage_step=10**9))
    steps.heard(1, "liar", pb.ForwardResponse(stage_step=10**9))
    assert steps.next_step(7) == 9 and steps.label(7) == 8
    assert steps.next_step(20) == 21  # never back: a trainer ahead of stale records goes on
