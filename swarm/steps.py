"""Which global step the swarm is at, from what its peers say: a majority's word, never the largest claim.

Every peer announces the optimizer steps its stage's weights include (`PeerRecord.optimizer_steps`).
The records are signed, so nobody speaks for another, but any member may announce any number. Were
the swarm's step the largest number announced, one member announcing 10^9 would start every joining
trainer at step 10^9, and the stages it sent that step to would skip to it (their learning rate
falling to the end of the schedule at once). So the step is what a strict majority of voters
reached, and a voter is a machine (the host of a peer's address: ids that one volunteer runs side
by side are one voter, speaking with the lowest step any of them announces), as in the spot checks
(swarm/verify.py `one_per_host`). A lie then moves the result only when most machines tell it.
"""

from __future__ import annotations

from collections.abc import Iterable

from swarm.records import PeerRecord, SwarmView


def host_of(address: str) -> str:
    """ "HOST:PORT" -> "HOST" (also "[V6]:PORT" -> "V6")."""
    host = address.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def majority_step(votes: Iterable[int]) -> int:
    """The largest step that more than half of `votes` reached (0 without votes): the median, rounded
    down. One vote of two, two of four, cannot raise it."""
    ranked = sorted(votes, reverse=True)
    return ranked[len(ranked) // 2] if ranked else 0


def host_votes(records: Iterable[PeerRecord]) -> list[int]:
    """One vote per machine among the online `records`: the lowest step its peers announce."""
    votes: dict[str, int] = {}
    for r in records:
        if r.state == "online":
            host = host_of(r.address)
            votes[host] = min(votes.get(host, r.optimizer_steps), r.optimizer_steps)
    return list(votes.values())


def swarm_step(view: SwarmView) -> int:
    """The global step all stages reached, as a majority of each stage's machines say: where a
    joining trainer starts. A stage with nobody online to say is left out (0 when none has anyone)."""
    steps = [majority_step(host_votes(view.online(k))) for k in range(len(view.stages)) if view.online(k)]
    return min(steps, default=0)


def others_step(view: SwarmView, me: str) -> int | None:
    """`swarm_step` without the peer `me`: how far a request may move that peer (peer/stepper.py
    `Stepper.admit`); None when nobody else is online. Every stage has its say, so a lie must win a
    majority in each; a stage whose peers all died leaves it to the others."""
    others = view.model_copy(update={"stages": [[r for r in stage if r.peer_id != me] for stage in view.stages]})
    if not any(others.online(k) for k in range(len(others.stages))):
        return None
    return swarm_step(others)
