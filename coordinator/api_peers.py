"""`/api/v1/peers/{peer}`: one volunteer's contribution, the dashboard's `/?peer=NAME` view.

Built from three sources, none of them the DHT: the peer's tally and speed points
(coordinator.contributions), the events that name it (coordinator.history: joins, moves, leaves,
failures, bans) and the latest swarm view (its records now, the trainers' spot-check bans and
receipts).
"""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, HTTPException, Path
from pydantic import BaseModel, Field

from coordinator.api_control import ErrorDetail
from coordinator.contributions import Contributions, SpeedPoint
from coordinator.events import Event, trainer_name
from coordinator.history import History
from coordinator.view import ViewHolder
from swarm.records import PeerRecord

STAGE_KINDS = ("join", "move", "leave", "failure", "control")
MAX_NAME = 256  # longer than any name or peer id a record carries


class PeerContribution(BaseModel):
    name: str = Field(description="its public name (the end of its peer id when it gave none)")
    peer_ids: list[str] = Field(
        description="every peer id seen under that name, oldest first (each start of `swarm peer` is a new one)"
    )
    records: list[PeerRecord] = Field(
        description="its records in the DHT now (two while it moves; none when it is gone), without DHT addresses"
    )
    online: bool = Field(description="whether one of its records is 'online'")
    stage: int = Field(description="the stage it serves now, else the last one it was seen on")
    uptime_s: float | None = Field(description="seconds since its running peer process started; None when gone")
    first_seen: float = Field(description="unix time the coordinator first read one of its records")
    last_seen: float = Field(description="unix time the coordinator last read one")
    samples_served: int = Field(
        description="samples it served over all its stints (every stage, every peer id), as its records said"
    )
    swarm_samples_served: int = Field(description="the same, summed over every peer the coordinator has seen")
    share: float | None = Field(description="samples_served / swarm_samples_served; None before any sample")
    receipts: int = Field(
        description="samples whose gradient the trainers saw it keep over their last steps (swarm/receipts.py): "
        "what others confirm it served, not what it claims"
    )
    banned_by: list[str] = Field(description="the trainers whose spot checks ban it now")
    bans: list[Event] = Field(description="the ban events that name it, oldest first")
    stage_history: list[Event] = Field(
        description="its joins, moves, leaves, failures and the operator's actions on it, oldest first"
    )
    speed: list[SpeedPoint] = Field(description="its announced samples/s over time, oldest first")


def peers_router(view_holder: ViewHolder, history: History, contributions: Contributions) -> APIRouter:
    router = APIRouter(prefix="/api/v1", tags=["peers"])

    @router.get(
        "/peers/{peer:path}",  # a name may hold a slash
        response_model=PeerContribution,
        responses={404: {"model": ErrorDetail}},
        summary="One volunteer's contribution: stage history, samples served, share, uptime, bans, speed",
    )
    def get_peer(
        peer: Annotated[
            str, Path(min_length=1, max_length=MAX_NAME, description="a peer id, or a public name (all its ids)")
        ],
    ) -> PeerContribution:
        ids = contributions.peer_ids(peer)
        tallies = contributions.tallies_of(ids)
        if not tallies:
            raise HTTPException(
                404, f"no peer {peer!r} is known to this coordinator: give a public name or a peer id it has seen"
            )
        name = tallies[-1].name
        view = view_holder.get()
        wanted = set(ids)
        records = [p.model_copy(update={"dht_addrs": []}) for s in view.stages for p in s if p.peer_id in wanted]
        online = [p for p in records if p.state == "online"]
        running = max(records, key=lambda p: p.started, default=None)
        served = sum(t.served for t in tallies)
        total = contributions.swarm_served()
        receipts = sum(
            count
            for r in view.trainers
            for by_peer in r.served.values()
            for pid, count in by_peer.items()
            if pid in wanted
        )
        return PeerContribution(
            name=name,
            peer_ids=ids,
            records=records,
            online=bool(online),
            stage=online[0].stage if online else max(tallies, key=lambda t: t.last_seen).stage,
            uptime_s=max(0.0, time.time() - running.started) if running and running.started > 0 else None,
            first_seen=min(t.first_seen for t in tallies),
            last_seen=max(t.last_seen for t in tallies),
            samples_served=served,
            swarm_samples_served=total,
            share=served / total if total > 0 else None,
            receipts=receipts,
            banned_by=[trainer_name(r) for r in view.trainers if wanted & r.spot_banned.keys()],
            bans=history.events_of(name, ["ban"]),
            stage_history=history.events_of(name, STAGE_KINDS),
            speed=contributions.speed(ids),
        )

    return router
