"""Whether a stage's replicas hold the same weights: each publishes a digest of its weights after every
step and load, and a replica whose digest is not the majority's loads the stage's state."""

from __future__ import annotations

import collections
import hashlib
import time
from collections.abc import Callable

import hivemind
import torch

from swarm.records import WeightsDigest, publish_digest, read_digests


def weights_digest(module: torch.nn.Module, sample: int = 65536) -> str:
    """A fingerprint of the weights' bits: up to `sample` evenly spaced elements of every tensor (a
    failed part of an all-reduce spans far more elements than the spacing)."""
    h = hashlib.blake2b(digest_size=16)
    with torch.no_grad():
        for p in module.parameters():
            flat = p.detach().reshape(-1)
            h.update(flat[:: max(1, flat.numel() // sample)].to("cpu").contiguous().numpy().tobytes())
    return h.hexdigest()


class ReplicaCheck:
    """After every step (diloco: every outer step, the outer weights) and every load, each replica
    publishes a digest of its weights; a replica whose digest is not the one most replicas hold
    has diverged. Ties go to a digest that a replica offering the stage's state holds (`sources`:
    hivemind's state holders), then to the one whose holder has the smallest peer id: a replica
    behind a home router (client mode) offers no state, and when it alone held the winning digest,
    the other replica could load it from nobody and went on looking, several times a second.
    Only the digests of the stage's members count (`swarm.records.read_digests`): a DHT node that
    serves no stage cannot outvote the replicas and make them reload the stage's state every step.

    hivemind reports an all-reduce that lost some parts ("received 88% of results") only in its log,
    and the round still counts as a success; the replicas then differ in those parts."""

    WAIT_S = 5.0  # how long after its step a replica keeps looking for the others' digests

    def __init__(
        self,
        dht: hivemind.DHT,
        run_id: str,
        stage: int,
        sources: Callable[[], set[str]] = set,
        members: Callable[[], set[str]] | None = None,
    ):
        """`sources`: the peer ids (base58) of the replicas that offer the stage's state, read at a tie;
        `members`: the peer ids with a record in the stage (None: read from the DHT at each look)."""
        self.dht, self.run_id, self.stage, self.sources = dht, run_id, stage, sources
        self.members = members
        self.me = dht.peer_id.to_base58()
        self.mine: tuple[int, str] | None = None
        self.settled = True  # nothing to check until the first step
        self.published_at = self.next_check = 0.0

    def publish(self, step: int, digest: str) -> None:
        self.mine = (step, digest)
        record = WeightsDigest(peer_id=self.me, stage=self.stage, step=step, digest=digest)
        publish_digest(self.dht, self.run_id, record)
        self.published_at = time.monotonic()
        self.next_check = self.published_at + 0.2
        self.settled = False

    def diverged(self, expected: int) -> bool:
        """True when this replica's weights differ from the stage's majority for its step. Looks at
        most every 0.5 s, until `expected` replicas have published or WAIT_S has passed."""
        if self.settled or self.mine is None or time.monotonic() < self.next_check:
            return False
        self.next_check = time.monotonic() + 0.5
        digests = read_digests(self.dht, self.run_id, self.stage, self.mine[0], self.members)
        if len(digests) >= expected or time.monotonic() - self.published_at > self.WAIT_S:
            self.settled = True
        if len(digests) < 2:
            return False
        holders = collections.Counter(digests.values())
        most = max(holders.values())
        tied = [d for d in holders if holders[d] == most]
        offered = {digests[p] for p in self.sources() if p in digests} if len(tied) > 1 else set()
        winner = min(tied, key=lambda d: (d not in offered, min(p for p, v in digests.items() if v == d)))
        return winner != self.mine[1]
