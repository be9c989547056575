"""Which global step the swarm is at, from what its peers say: a majority's word, never the largest claim.

Every peer announces the optimizer steps its stage's weights include (`PeerRecord.optimizer_steps`).
The records are signed, so nobody speaks for another, but any member may announce any number. Were
the swarm's step the largest number announced, one member announcing 10^9 would start every joining
trainer at step 10^9, and the stages it sent that step to would skip to it (their learning rate
falling to the end of the schedule at once). A voter is a machine (the host of a peer's address: ids
that one volunteer runs side by side are one voter, speaking with the lowest step any of them
announces), as in the spot checks (swarm/verify.py `one_per_host`), and the swarm's step is

- no more than what a strict majority of all the swarm's machines reached: a lie moves it only when
  most machines tell it;
- no more than what half of each stage's machines reached: a stage behind the others (its peers all
  died, and a newcomer started it again) holds it back. Half, not a majority, because honest
  replicas of a stage may disagree for a while: one that just started from the seeded init beside
  one that resumed a checkpoint is behind, not right, and loads the other's state within seconds.
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


def half_step(votes: Iterable[int]) -> int:
    """The largest step that at least half of `votes` reached (0 without votes): the median, rounded up."""
    ranked = sorted(votes, reverse=True)
    return ranked[(len(ranked) - 1) // 2] if ranked else 0


def host_votes(records: Iterable[PeerRecord]) -> list[int]:
    """One vote per machine among the online `records`: the lowest step its peers announce."""
    votes: dict[str, int] = {}
    for r in records:
        if r.state == "online":
            host = host_of(r.address)
            votes[host] = min(votes.get(host, r.optimizer_steps), r.optimizer_steps)
    return list(votes.values())


def swarm_step(view: SwarmView) -> int:
    """The global step all stages reached, as the swarm's machines say (see above): where a joining
    trainer starts. A stage with nobody online to say is left out (0 when none has anyone)."""
    stages = [half_step(host_votes(view.online(k))) for k in range(len(view.stages)) if view.online(k)]
    if not stages:
        return 0
    everyone = host_votes(r for k in range(len(view.stages)) for r in view.online(k))
    return min(*stages, majority_step(everyone))


def others_step(view: SwarmView, me: str) -> int | None:
    """`swarm_step` without the peer `me`: how far a request may move that peer (peer/stepper.py
    `Stepper.reachable`); None when nobody else is online. A stage whose peers all died leaves it to the
    others."""
    others = view.model_copy(update={"stages": [[r for r in stage if r.peer_id != me] for stage in view.stages]})
    if not any(others.online(k) for k in range(len(others.stages))):
        return None
    return swarm_step(others)
