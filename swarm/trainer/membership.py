"""Who serves each stage of a swarm, as a trainer sees it: read from the DHT every few seconds.

Every `refresh_s` the trainer reads each stage's online peers from the DHT and hands them to that
stage's `Router` (swarm/routing.py), with their addresses. Peers the operator removed, and peers
this trainer's spot checks banned, are left out. When a stage looks empty, the trainer pings the DHT
nodes it knew (the coordinator's, the peers' last announced ones), in case it is the trainer that
lost touch with the DHT (`records.Reconnector`). The operator's word comes through the DHT too:
while the run is paused no new global step starts. The trainer announces its own record (steps,
loss, tokens/s, failed calls, bans, bytes on the wire, spot checks) in the same rounds.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator

import hivemind
from hivemind.utils import get_dht_time

from swarm.config import RunConfig
from swarm.identity import Member
from swarm.receipts import Receipts, impossible
from swarm.records import (
    REFRESH_S,
    ControlState,
    Reconnector,
    TrainerRecord,
    announce_trainer,
    maddr_peer_ids,
    read_control,
    read_progress,
    read_removed,
    read_swarm,
    shutdown_dht,
)
from swarm.routing import Router
from swarm.steps import host_of, swarm_step
from swarm.trainer.caller import event
from swarm.verify import SpotChecks


class Membership:
    """The stages' routers and peer addresses, the operator's control state and this trainer's record;
    refreshed from the DHT in a background thread until `close`."""

    def __init__(
        self,
        run: RunConfig,
        dht: hivemind.DHT,
        initial_peers: list[str],
        spot: SpotChecks,
        refresh_s: float = 2.0,
        member: Member | None = None,
    ):
        """`dht`: a client node of the run's DHT, joined through the coordinator at `initial_peers`
        (swarm.join.join_dht), whose word on pauses and removals counts; `spot`: this trainer's spot
        checks, whose banned peers get no calls until their ban ends; `member`: this trainer's run
        membership, whose revoked peers are the removed ones (read by it, not again here)."""
        self.run, self.dht, self.spot, self.member = run, dht, spot, member
        self.num_stages = run.stages.count
        self.trainer_id = uuid.uuid4().hex[:12]
        self.record = TrainerRecord(trainer_id=self.trainer_id, public_name=f"trainer-{self.trainer_id[:6]}")
        self.receipts = Receipts()  # the samples each peer kept gradients of, announced in the record
        self.coordinators = maddr_peer_ids(initial_peers)
        self.reconnector = Reconnector(dht, initial_peers)
        self._routers = [Router() for _ in range(self.num_stages)]
        self._addresses: list[dict[str, str]] = [{} for _ in range(self.num_stages)]
        self._control = ControlState()
        self._swarm_step = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.refresh()
        self._refresher = threading.Thread(target=self._refresh_loop, args=(refresh_s,), daemon=True)
        self._refresher.start()

    def refresh(self) -> None:
        for peer in self.spot.release():
            event(f"spot check: the ban of peer {peer} ended; its calls are checked until it passes again")
        view = read_swarm(self.dht, self.run.run_id, self.num_stages)
        if self.reconnector.check(view):  # a stage looks empty: maybe this node lost touch with the DHT
            view = read_swarm(self.dht, self.run.run_id, self.num_stages)
        self._convict_liars()
        removed = self._removed()  # by the operator: they are leaving
        control = read_control(self.dht, self.run.run_id, self.coordinators)
        now, dht_now = time.monotonic(), get_dht_time()
        with self._lock:
            self._control = control
            self._swarm_step = swarm_step(view)
            for k in range(self.num_stages):
                online = [
                    p
                    for p in view.routable(k, dht_now)
                    if p.peer_id not in removed and p.peer_id not in self.spot.banned and p.reach != "unreachable"
                ]  # a peer the coordinator could not dial back is no one's to call (coordinator/api_reachability.py)
                self._routers[k].update_peers({p.peer_id: p.throughput for p in online}, now)
                self._addresses[k] = {p.peer_id: p.address for p in online}

    def _removed(self) -> frozenset[str]:
        """The peers the operator removed: the membership's last reading of them (every
        REVOCATION_POLL_S), else the DHT's records now."""
        if self.member is not None:
            return self.member.revoked
        return frozenset(read_removed(self.dht, self.run.run_id, self.coordinators))

    def _convict_liars(self) -> None:
        """Ban the peers whose own signed progress reports claim more samples toward one step than any
        replica holds (swarm/receipts.py): a lie about their weight in their stage's average."""
        for k in range(self.num_stages):
            for peer in impossible(read_progress(self.dht, self.run.run_id, k), self.run.training.global_batch):
                if self.spot.convict(k, peer):
                    event(f"peer {peer} of stage {k} declared more samples for one step than any peer holds: banned")
                    self.record = self.record.model_copy(update={"served": self._receipts()})

    def _receipts(self) -> dict[str, dict[str, int]]:
        """The receipts to announce: none for the peers this trainer banned (it vouches for no liar)."""
        banned = self.spot.banned
        return {k: {p: n for p, n in peers.items() if p not in banned} for k, peers in self.receipts.recent().items()}

    @contextlib.contextmanager
    def stage(self, stage: int) -> Iterator[tuple[Router, dict[str, str]]]:
        """The router of `stage` and its peers' addresses (peer id -> HOST:PORT), held for the caller
        alone until the block ends (the microbatch threads and the refresh share them)."""
        with self._lock:
            yield self._routers[stage], self._addresses[stage]

    def live(self, stage: int) -> list[str]:
        """The peers of `stage` that are routed to and not banned now."""
        with self.stage(stage) as (router, addresses):
            now = time.monotonic()
            return [p for p in addresses if not router.is_banned(p, now)]

    def hosts(self, stage: int) -> dict[str, str]:
        """The host part of each peer's address on `stage` (peer id -> host): a spot check counts one
        vote per host (swarm/verify.py `one_per_host`)."""
        with self.stage(stage) as (_, addresses):
            return {p: host_of(a) for p, a in addresses.items()}

    def drop(self, stage: int, peer: str) -> None:
        """Route no more calls to `peer` (the refresh leaves it out too while the spot checks ban it)."""
        with self.stage(stage) as (router, addresses):
            router.remove(peer)
            addresses.pop(peer, None)

    def paused(self) -> bool:
        with self._lock:
            return self._control.paused

    def swarm_step(self) -> int:
        """The global step the stages are at, as most of their machines announced it at the last
        refresh (swarm/steps.py): where a joining trainer starts, and one short of the furthest step it
        names (swarm/trainer/loop.py `StageSteps`)."""
        with self._lock:
            return self._swarm_step

    def report(self, record: dict, bans: int) -> None:
        """This trainer's numbers after a step (its `--log-json` record, and the failing peers its
        calls banned), announced with the next refresh."""
        self.receipts.next_step()
        self.record = self.record.model_copy(
            update={
                "samples": record["microbatches"] * self.run.training.micro_batch,
                "steps": record["step"] + 1,
                "loss": record["loss"],
                "val_loss": record.get("val_loss", self.record.val_loss),
                "tokens_per_s": record["tokens_per_s"],
                "failures": record["failures"],
                "bans": bans,
                "wire_bytes": record["wire_bytes"],
                "spot_checks": self.spot.checks,
                "spot_disagreements": self.spot.disagreements,
                "spot_bans": self.spot.bans,
                "spot_banned": dict(self.spot.banned),
                "served": self._receipts(),
            }
        )

    def _refresh_loop(self, period: float) -> None:
        last_announce = 0.0
        while not self._stop.wait(period):
            try:
                self.refresh()
                if time.monotonic() - last_announce >= REFRESH_S:
                    announce_trainer(self.dht, self.run.run_id, self.record)
                    last_announce = time.monotonic()
            except Exception as err:  # a DHT hiccup must not end training; the next round retries
                event(f"DHT read failed: {err!r}")

    def close(self) -> None:
        self._stop.set()
        self._refresher.join(timeout=5)
        # The last step's numbers, for the coordinator to show until the record expires.
        announce_trainer(self.dht, self.run.run_id, self.record, timeout=2)
        shutdown_dht(self.dht)
