"""The coordinator's history endpoints: the run's progress over time, and what happened in the swarm.

Both answer from the History store (coordinator.history, SQLite), never from the DHT, so they
survive a coordinator restart and never wait on the network. Query parameters are validated by
FastAPI: a bad one gets 422 naming it.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel

from coordinator.events import Event
from coordinator.history import MAX_POINTS, History, HistoryPoint

SQLITE_MAX_INT = 2**63 - 1


class HistoryResponse(BaseModel):
    points: list[HistoryPoint]


class EventsResponse(BaseModel):
    events: list[Event]


def history_router(history: History) -> APIRouter:
    router = APIRouter(prefix="/api/v1", tags=["history"])

    @router.get(
        "/history",
        response_model=HistoryResponse,
        summary="The run's progress over time",
        description="One point every 2 s at most while anything changes, oldest first. More than "
        f"{MAX_POINTS:,} points are thinned out evenly (the newest is always there).",
    )
    def get_history(
        since: Annotated[float | None, Query(ge=0, description="only points at or after this unix time")] = None,
    ) -> HistoryResponse:
        return HistoryResponse(points=history.points(since))

    @router.get(
        "/events",
        response_model=EventsResponse,
        summary="Joins, leaves, moves, failures, bans, steps and the operator's actions",
        description="Ascending id. With `after`: the first `limit` events after it; without: the newest `limit`.",
    )
    def get_events(
        after: Annotated[int | None, Query(ge=0, le=SQLITE_MAX_INT, description="only events with a larger id")] = None,
        limit: Annotated[int, Query(ge=1, le=1000, description="at most this many events")] = 200,
    ) -> EventsResponse:
        return EventsResponse(events=history.events(after, limit))

    return router
