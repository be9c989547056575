"""Which trainer reads which shard of the run's data: leases, handed out by the coordinator.

The run's data is cut into shards (swarm.data.shards); within an epoch each shard is read once, from
its first window to its last, by one trainer at a time, in an order drawn for each epoch from the
run's seed (swarm.data.epoch_order, the order of a trainer reading alone). A trainer asks for a
lease, gets the first shard in that order that is neither done nor leased, at the offset (windows
already trained) last reported for it, and renews the lease with its progress while it reads. A lease not renewed within
`ttl_s` expires: its shard goes to the next trainer that asks, from the last reported offset (a
trainer that left hands its shard over that way). When every shard of the epoch is done, the next
epoch starts, every shard again from offset 0.

Once every shard of the epoch is done or leased, an asker gets the first free shard of the next
epoch (in that epoch's order), as a trainer reading alone moves on to the next epoch's first shard
while its last ones are still in its shuffle buffer. Waiting for the epoch's last shards to be
trained instead stalled a lone trainer at every epoch's end (its buffer drained: about 5 s on
tiny.toml), and its batches were no longer those of a trainer alone. Never more than one epoch
ahead, and an expired lease of the current epoch goes out again before any shard of the next.

A pure policy (an injected clock, no HTTP), like swarm/routing.py. The state is written whole to
`state_dir/leases.json` at each change (coordinator.invites.write_private), before it is answered:
what a trainer was told is what a restarted coordinator finds, so a restart does not start the epoch
again. Leases found at a start get a full `ttl_s` from the first request served: their holders could not
renew while the coordinator was down.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from coordinator.invites import read_state, write_private
from swarm.config import ConfigError
from swarm.data import epoch_order

DEFAULT_TTL_S = 30.0
LEASE_ID_BYTES = 16


class LeaseError(ValueError):
    """A report about a lease that cannot be taken; the message says why."""


class UnknownLease(LeaseError):
    """No live lease has that id: it never existed, it expired, or its shard is done."""


class Lease(BaseModel):
    """A shard leased to one trainer: what the coordinator keeps, and what it answers (with `expires`
    turned into seconds from now)."""

    model_config = ConfigDict(extra="forbid")

    lease_id: str
    shard: int = Field(ge=0)
    trainer: str
    epoch: int = Field(ge=0)
    offset: int = Field(ge=0, description="windows of the shard trained in this epoch, as last reported")
    expires: float = Field(description="unix time at which the lease expires unless renewed")


class ShardProgress(BaseModel):
    model_config = ConfigDict(extra="forbid")

    offset: int = Field(0, ge=0, description="windows trained in the current epoch")
    done: bool = False


class LeaseFile(BaseModel):
    """`leases.json`."""

    model_config = ConfigDict(extra="forbid")

    names: list[str] = Field(description="the run's shards, in order: a different list is another run's data")
    epoch: int = Field(0, ge=0)
    shards: list[ShardProgress]
    ahead: list[ShardProgress] | None = Field(
        None, description="the next epoch's shards, once one of them is leased before this epoch ended"
    )
    leases: list[Lease] = Field(default_factory=list, description="of the epoch, and of the next")


class ShardCount(BaseModel):
    epoch: int
    shards: int
    done: int
    leased: int
    free: int
    ahead: int = Field(description="shards of the next epoch leased or done already (this epoch's are all leased)")


class ShardLeases:
    """The leases of one run's shards (`names`, in order); thread-safe. `path` None keeps them in memory."""

    def __init__(
        self,
        names: list[str],
        path: Path | None = None,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.time,
        seed: int = 0,
    ):
        """`seed`: the run's (training.seed), from which each epoch's order of the shards is drawn."""
        if not names:
            raise ConfigError("data: the run's data has no shards to lease")
        self.names, self.path, self.ttl_s, self.clock, self.seed = list(names), path, ttl_s, clock, seed
        self._lock = threading.Lock()
        self._restored = False  # leases read from the file, not yet given their time from the first request
        self._state = self._load()

    def _load(self) -> LeaseFile:
        fresh = LeaseFile(names=self.names, shards=[ShardProgress() for _ in self.names])
        if self.path is None or not self.path.exists():
            return fresh
        fix = "remove it to start the data from its first epoch"
        saved = read_state(self.path, LeaseFile, "the run's shard leases", fix)
        count = len(self.names)
        if saved.names != self.names or len(saved.shards) != count or len(saved.ahead or self.names) != count:
            raise ConfigError(
                f"{self.path}: the shard leases are of other data ({len(saved.names)} shards, not the "
                f"{len(self.names)} of this run's data section): remove the file to start this data from its "
                "first epoch"
            )
        self._restored = bool(saved.leases)
        return saved

    def _save(self, state: LeaseFile) -> None:
        """Write the state first, then take it: what a trainer is told is what a restart finds."""
        if self.path is not None:
            write_private(self.path, state.model_dump_json(indent=1) + "\n")
        self._state = state

    def _live(self, now: float) -> LeaseFile:
        """The state without the leases expired at `now`, and in the next epoch when every shard is done."""
        if self._restored:  # their holders could not renew while the coordinator was down, nor while it started
            self._restored = False
            later = [lease.model_copy(update={"expires": now + self.ttl_s}) for lease in self._state.leases]
            self._state = self._state.model_copy(update={"leases": later})
        state = self._state
        leases = [lease for lease in state.leases if lease.expires > now]
        if len(leases) != len(state.leases):
            state = state.model_copy(update={"leases": leases})
        while all(s.done for s in state.shards):  # twice when the next epoch, read ahead, is done too
            shards = state.ahead or self._fresh()
            state = state.model_copy(update={"epoch": state.epoch + 1, "shards": shards, "ahead": None})
        return state

    def _fresh(self) -> list[ShardProgress]:
        return [ShardProgress() for _ in self.names]

    def _progress_in(self, state: LeaseFile, epoch: int) -> list[ShardProgress]:
        """The shards' progress in `epoch`: the state's epoch, or the next."""
        return state.shards if epoch == state.epoch else state.ahead or self._fresh()

    def _first_free(self, state: LeaseFile, epoch: int) -> int | None:
        """The first shard of `epoch` (the state's, or the next), in its order, neither done nor leased."""
        progress = self._progress_in(state, epoch)
        taken = {lease.shard for lease in state.leases if lease.epoch == epoch}
        order = epoch_order(len(self.names), self.seed, epoch)
        return next((k for k in order if not progress[k].done and k not in taken), None)

    def grant(self, trainer: str) -> Lease | None:
        """A lease for `trainer` on the first shard, in the epoch's order, neither done nor leased, from
        its last reported offset; once every shard of the epoch is done or leased, the first such
        shard of the next epoch; None when those are all leased too (ask again later)."""
        with self._lock:
            now = self.clock()
            state = self._live(now)
            epoch = state.epoch
            k = self._first_free(state, epoch)
            if k is None:
                epoch += 1
                k = self._first_free(state, epoch)
            if k is None:
                if state is not self._state:
                    self._save(state)
                return None
            progress = self._progress_in(state, epoch)
            lease = Lease(
                lease_id=secrets.token_urlsafe(LEASE_ID_BYTES),
                shard=k,
                trainer=trainer,
                epoch=epoch,
                offset=progress[k].offset,
                expires=now + self.ttl_s,
            )
            ahead = progress if epoch > state.epoch else state.ahead
            self._save(state.model_copy(update={"leases": [*state.leases, lease], "ahead": ahead}))
            return lease

    def renew(self, lease_id: str, offset: int, done: bool = False, release: bool = False) -> Lease:
        """Renew the lease `lease_id` for another `ttl_s` with its holder's progress: `offset` windows of
        the shard trained; `done`: the shard is read to its end (the lease ends); `release`: its holder
        leaves (the lease ends, and the shard goes to the next trainer that asks, from `offset`). The
        offset never goes back (the windows before it are trained: handing them out again would train
        them twice)."""
        with self._lock:
            now = self.clock()
            state = self._live(now)
            lease = next((x for x in state.leases if x.lease_id == lease_id), None)
            if lease is None:
                if state is not self._state:
                    self._save(state)
                raise UnknownLease(
                    f"no lease {lease_id!r}: it expired (not renewed within {self.ttl_s:g} s, its shard goes to "
                    "the next trainer that asks), its shard is done, or it never existed"
                )
            if offset < lease.offset:
                raise LeaseError(
                    f"offset: {offset} is below the {lease.offset} windows of shard {lease.shard} already "
                    "reported trained (an offset never goes back)"
                )
            renewed = lease.model_copy(update={"offset": offset, "expires": now + self.ttl_s})
            progress = list(self._progress_in(state, lease.epoch))
            progress[lease.shard] = ShardProgress(offset=offset, done=done)
            leases = [x for x in state.leases if x.lease_id != lease_id] + ([] if done or release else [renewed])
            field = "shards" if lease.epoch == state.epoch else "ahead"
            self._save(state.model_copy(update={field: progress, "leases": leases}))
            return renewed

    def count(self) -> ShardCount:
        """The current epoch's shards: done, leased (to a trainer now) and free; and how many of the
        next epoch's are leased or done already."""
        with self._lock:
            state = self._live(self.clock())
        done = sum(s.done for s in state.shards)
        leased = sum(lease.epoch == state.epoch for lease in state.leases)
        ahead = sum(lease.epoch > state.epoch for lease in state.leases) + sum(s.done for s in state.ahead or [])
        n = len(self.names)
        return ShardCount(epoch=state.epoch, shards=n, done=done, leased=leased, free=n - done - leased, ahead=ahead)

    def leases(self) -> list[Lease]:
        """The live leases, of the current epoch and of the next, oldest first."""
        with self._lock:
            return list(self._live(self.clock()).leases)

    def progress(self, ahead: bool = False) -> tuple[int, list[ShardProgress]]:
        """The current epoch (`ahead`: the next) and each shard's progress in it, in shard order."""
        with self._lock:
            state = self._live(self.clock())
            epoch = state.epoch + ahead
            return epoch, list(self._progress_in(state, epoch))
