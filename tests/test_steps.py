"""The swarm's step is a majority's word (swarm/steps.py), and a request cannot move a stage past it
(peer/stepper.py `reachable`): pure policy, and one real worker."""

from __future__ import annotations

import grpc
import pytest
import torch

from peer.requests import ForwardWork, RequestError
from peer.worker import StageWorker
from swarm.config import load_config
from swarm.records import PeerRecord, SwarmView
from swarm.steps import half_step, host_votes, majority_step, others_step, swarm_step
from tests.conftest import CONFIGS

HUGE = 10**9


def peer(name: str, stage: int, steps: int, host: str | None = None, state: str = "online") -> PeerRecord:
    return PeerRecord(peer_id=name, stage=stage, address=f"{host or name}:5000", state=state, optimizer_steps=steps)


def view(*stages: list[PeerRecord]) -> SwarmView:
    return SwarmView(stages=list(stages), trainers=[], read_at=0.0)


def test_the_majority_step_is_what_more_than_half_reached():
    assert majority_step([]) == 0
    assert majority_step([7]) == 7
    assert majority_step([7, HUGE]) == 7  # one of two cannot raise it
    assert majority_step([7, 8, HUGE]) == 8
    assert majority_step([7, HUGE, HUGE]) == HUGE  # two of three can: they are the majority
    assert majority_step([5, 7, 8, HUGE]) == 7
    assert half_step([0, 4]) == 4 and half_step([0, 0, 4]) == 0 and half_step([]) == 0


def test_ids_on_one_machine_vote_once_with_their_lowest_step():
    records = [peer("a", 0, 7), peer("s1", 0, HUGE, host="sybil"), peer("s2", 0, HUGE + 1, host="sybil")]
    assert sorted(host_votes(records)) == [7, HUGE]
    assert majority_step(host_votes(records)) == 7  # two ids, one voter: no majority for the lie
    assert host_votes([peer("a", 0, 7), peer("b", 0, HUGE, state="joining")]) == [7]  # online only


def test_a_joining_trainer_starts_where_most_machines_are_and_no_stage_is_behind():
    assert swarm_step(view([peer("a", 0, 12), peer("x", 0, HUGE)], [peer("b", 1, 12), peer("y", 1, HUGE)])) == 12
    # The largest claim would have been HUGE; the stages' minimum of their largest, too.
    assert swarm_step(view([peer("a", 0, 12)], [peer("b", 1, 11), peer("c", 1, 11)])) == 11
    assert swarm_step(view([peer("a", 0, 12)], [])) == 12  # a stage with nobody to say is left out
    assert swarm_step(view([], [])) == 0
    # A replica that started from the seeded init beside one that resumed a checkpoint at step 4 is
    # behind, not right: half of its stage is at 4, as is most of the swarm.
    resumed = view([peer("s0", 0, 4)], [peer("fresh", 1, 0), peer("resumed", 1, 4)])
    assert swarm_step(resumed) == 4
    # A stage that most of whose machines are behind (its peers all died) holds the swarm back.
    assert swarm_step(view([peer("a", 0, 50), peer("b", 0, 50)], [peer("new", 1, 0)])) == 0


def test_what_bounds_a_peer_is_the_other_machines_of_every_stage():
    swarm = view([peer("me", 0, 0), peer("a", 0, 30)], [peer("b", 1, 30), peer("c", 1, 31)])
    assert others_step(swarm, "me") == 30  # the peer's own step has no say
    lied = view([peer("me", 0, 30), peer("a", 0, 30)], [peer("b", 1, 30), peer("y", 1, HUGE)])
    assert others_step(lied, "me") == 30  # one liar of three other machines
    # A stage whose peers all died: the new peer takes the step from the other stage's machines.
    assert others_step(view([peer("me", 0, 0)], [peer("b", 1, 30)]), "me") == 30
    assert others_step(view([peer("me", 0, 0)], []), "me") is None  # alone: nobody to bound it


@pytest.fixture
def worker():
    w = StageWorker(load_config(CONFIGS / "tiny.toml"), 1, torch.device("cpu"))
    yield w
    w.close()


def forward(run, step: int) -> ForwardWork:
    return ForwardWork(torch.randn(1, 16, run.model.d_model), None, False, 0.0, f"at-{step}", step)


def test_a_request_for_a_step_far_ahead_of_the_swarm_is_refused_and_moves_nothing(worker):
    worker.stepper.swarm_step = 3  # most other machines announce step 3; this replica is at 0
    refused = worker.submit(forward(worker.run, 2**31 - 2)).exception(timeout=30)
    assert isinstance(refused, RequestError) and refused.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "step: 2147483646 is ahead of the swarm" in refused.message and "announce step 3" in refused.message
    assert worker.optimizer_steps == 0 and not worker.stepper.skipped_steps
    # Up to one past what the swarm announces is served: a stage whose peers all died catches up.
    assert worker.submit(forward(worker.run, 4)).result(timeout=30).output is not None
    assert worker.optimizer_steps == 4 and worker.stepper.skipped_steps == [range(0, 4)]


def test_without_a_view_of_a_swarm_a_worker_takes_the_callers_step(worker):
    """A stage served by hand (`swarm peer --config`) has no records to go by: its one trainer is
    its only source of steps."""
    assert worker.stepper.swarm_step is None
    assert worker.submit(forward(worker.run, 6)).result(timeout=30).output is not None
    assert worker.optimizer_steps == 6
