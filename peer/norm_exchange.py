"""The gradient norm over the whole model, from every stage's share (`NormExchange`)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence

import hivemind

from swarm import norms
from swarm.records import NormShare, publish_norm_share, read_norm_shares, stage_members, stage_norms

log = logging.getLogger("swarm.averaging")


class NormExchange:
    """The gradient norm over the whole model, from every stage's share.

    The reference trainer clips the norm of all parameters together; a stage sees only its own. At
    each step every replica of stage k publishes its averaged gradient's squared norm, pushed to the
    other stages' members and stored in the DHT (the replicas of a stage publish the same number;
    `swarm.records.stage_norms` takes the median of a stage's members' shares, and nobody else's),
    and waits for the other stages' shares, at most `timeout` seconds; then it falls back to its own
    norm."""

    SKIPPED_SHARES = 8  # a stage that skips steps publishes a share of 0 for at most this many of them
    MEMBERS_MAX_AGE_S = 2.0  # a stage's members are read again once the last read is this old
    DHT_READ_AFTER_S = 0.5  # the pushed shares come first; the DHT's records are read after this, and as often

    def __init__(
        self,
        dht: hivemind.DHT,
        run_id: str,
        stages: int,
        stage: int,
        timeout: float,
        idle: Callable[[], None] | None = None,
    ):
        """`idle`: called between looks at the DHT while waiting (default: a 20 ms sleep)."""
        self.dht, self.run_id, self.stages, self.stage = dht, run_id, stages, stage
        self.timeout, self.idle = timeout, idle or (lambda: time.sleep(0.02))
        self.me = dht.peer_id.to_base58()
        self.step = 0  # the global step being taken, set by the updater before each step
        self.waited = 0.0
        self.members_read: dict[int, tuple[float, set[str]]] = {}  # stage -> (when read, its peer ids)
        if stages > 1:
            norms.serve(dht)

    def publish(self, step: int, squared: float) -> None:
        """This stage's share of global step `step` (0.0 for a step it skipped): pushed straight to the
        other stages' members (swarm/norms.py), and stored in the DHT for any the push does not reach,
        without waiting for the DHT to confirm (a confirmed store took about 1 s on a loaded 2-core
        machine)."""
        if self.stages > 1:
            share = NormShare(peer_id=self.me, stage=self.stage, step=step, squared=squared)
            publish_norm_share(self.dht, self.run_id, share, timeout=0)
            others = [m for k in range(self.stages) if k != self.stage for m in self.members(k)]
            norms.push(self.dht, self.run_id, share, others)

    def members(self, stage: int) -> set[str]:
        """The peer ids of `stage`, read again once the last read is MEMBERS_MAX_AGE_S old: a step's
        polls would otherwise read every stage's records on every look at the shares. The updater's
        step round and replica check read their own stage's members here too (a DHT read each, per
        step, before; a peer that joined or left the stage is seen within MEMBERS_MAX_AGE_S, far
        less than a record's TTL_S)."""
        read_at, members = self.members_read.get(stage, (-math.inf, set()))
        if time.monotonic() - read_at > self.MEMBERS_MAX_AGE_S:
            members = stage_members(self.dht, self.run_id, stage)
            self.members_read[stage] = (time.monotonic(), members)
        return members

    def others(self, step: int, stored: Sequence[NormShare] = ()) -> dict[int, float]:
        """The other stages' shares of `step` this node has (stage -> squared norm): those pushed to it,
        and `stored` (read from the DHT). Each stage's share is the median of its members' (one share
        per sender: a pushed one and its DHT record say the same)."""
        found = {s.peer_id: s for s in [*stored, *norms.received(self.dht, self.run_id, step)]}
        wanted = {s.stage for s in found.values() if s.stage < self.stages} - {self.stage}
        return stage_norms(list(found.values()), step, {k: self.members(k) for k in wanted})

    def __call__(self, squared: float) -> float:
        if self.stages == 1:
            return math.sqrt(squared)
        self.publish(self.step, squared)
        t0 = time.monotonic()
        deadline = t0 + self.timeout
        stored, stored_at = [], t0  # the DHT's records are read first after DHT_READ_AFTER_S
        while True:
            if time.monotonic() - stored_at > self.DHT_READ_AFTER_S:
                stored, stored_at = read_norm_shares(self.dht, self.run_id, self.step), time.monotonic()
            shares = self.others(self.step, stored)
            # This stage's own share is the one just computed: the replicas of a stage average the same
            # gradient, so the stage's median is this number (and a lying member cannot move it here).
            shares[self.stage] = squared
            self.waited = time.monotonic() - t0  # logged with the step
            if len(shares) == self.stages:
                return math.sqrt(sum(shares.values()))
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.stages)) - set(shares))
                log.warning(f"stage {self.stage} step {self.step}: no gradient norm from stage(s) {missing}; own norm")
                return math.sqrt(squared)
            self.idle()
