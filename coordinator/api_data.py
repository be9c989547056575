"""The coordinator's data endpoints: shard leases for the run's trainers (coordinator.leases).

A trainer asks for a lease (`POST /api/v1/data/lease`) and renews it with its progress
(`POST /api/v1/data/lease/{lease_id}`) while it reads the shard; both want what joining the run
wants (the join token, or an invite's, in a guarded run). A lease id is a secret of its holder:
only the trainer it was given to can report on it. Anyone may read how far the epoch is
(`GET /api/v1/data`), as anyone may read the swarm's state.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations at runtime, and
# the dependency they use is local to the coordinator's app.
from collections.abc import Callable

from fastapi import APIRouter, Depends, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from coordinator.api_control import ErrorDetail
from coordinator.leases import Lease, LeaseError, ShardCount, ShardLeases, UnknownLease

TRAINER_ID = r"^[A-Za-z0-9._-]{1,64}$"
MAX_OFFSET = 2**62  # far above any shard's windows; keeps the number a number


class LeaseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    trainer: str = Field(pattern=TRAINER_ID, description="the asking trainer's id (1 to 64 letters, digits, ._-)")


class RenewRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    offset: int = Field(ge=0, le=MAX_OFFSET, description="windows of the shard trained in this epoch, from its start")
    done: bool = Field(False, description="the shard is read to its end: the lease ends")
    release: bool = Field(
        False, description="the trainer leaves: the lease ends and the shard goes to the next trainer, from offset"
    )


class LeaseInfo(BaseModel):
    lease_id: str = Field(description="renew the lease at /api/v1/data/lease/{lease_id}; a secret of its holder")
    shard: int = Field(description="the shard's index in the run's list of shards")
    name: str = Field(description="the shard's name (a file, a part of a dataset): the trainer checks it")
    epoch: int = Field(description="passes over the data before this one")
    offset: int = Field(description="read the shard from this window on: those before it are trained")
    expires_in_s: float = Field(description="renew before this many seconds, or the shard goes to another trainer")


class LeaseAnswer(BaseModel):
    lease: LeaseInfo | None = Field(
        description="null: every shard not done, of this epoch and of the next, is leased to a trainer now"
    )
    retry_s: float = Field(description="with no lease: ask again after this many seconds")


class ShardState(BaseModel):
    shard: int
    name: str
    offset: int = Field(description="windows trained in the current epoch")
    done: bool
    trainer: str | None = Field(description="the trainer that holds its lease now; null: none")


class DataState(BaseModel):
    count: ShardCount
    lease_ttl_s: float = Field(description="a lease not renewed for this long expires")
    shards: list[ShardState]
    ahead: list[ShardState] = Field(
        description="the next epoch's shards leased or read already: once every shard of the epoch is done or "
        "leased, trainers read on into the next"
    )


def data_router(leases: ShardLeases, admitted: Callable[..., object], refused: dict) -> APIRouter:
    """/api/v1/data: the epoch's shards for anyone; leases for those `admitted` lets in (the
    dependency that guards joining the run, which answers as `refused` says)."""
    router = APIRouter(prefix="/api/v1", tags=["data"])
    retry_s = min(1.0, leases.ttl_s / 4)

    def info(lease: Lease) -> LeaseInfo:
        return LeaseInfo(
            lease_id=lease.lease_id,
            shard=lease.shard,
            name=leases.names[lease.shard],
            epoch=lease.epoch,
            offset=lease.offset,
            expires_in_s=max(0.0, lease.expires - leases.clock()),
        )

    @router.get("/data", response_model=DataState, summary="The current epoch's shards: done, leased, free")
    def data() -> DataState:
        held = leases.leases()

        def states(ahead: bool) -> list[ShardState]:
            epoch, progress = leases.progress(ahead)
            holders = {lease.shard: lease.trainer for lease in held if lease.epoch == epoch}
            return [
                ShardState(shard=k, name=name, offset=p.offset, done=p.done, trainer=holders.get(k))
                for k, (name, p) in enumerate(zip(leases.names, progress, strict=True))
            ]

        started = [s for s in states(True) if s.trainer or s.offset or s.done]
        return DataState(count=leases.count(), lease_ttl_s=leases.ttl_s, shards=states(False), ahead=started)

    @router.post(
        "/data/lease",
        response_model=LeaseAnswer,
        responses={422: {"model": ErrorDetail}, **refused},
        dependencies=[Depends(admitted)],
        summary="Lease the next shard of the epoch to a trainer",
    )
    def lease(request: LeaseRequest) -> LeaseAnswer:
        granted = leases.grant(request.trainer)
        return LeaseAnswer(lease=info(granted) if granted else None, retry_s=retry_s)

    @router.post(
        "/data/lease/{lease_id}",
        response_model=LeaseInfo,
        responses={404: {"model": ErrorDetail}, 409: {"model": ErrorDetail}, 422: {"model": ErrorDetail}, **refused},
        dependencies=[Depends(admitted)],
        summary="Renew a lease with its holder's progress; or end it (done: the shard is read to its end; release)",
    )
    def renew(lease_id: str, request: RenewRequest) -> LeaseInfo:
        try:
            return info(leases.renew(lease_id, request.offset, request.done, request.release))
        except UnknownLease as err:
            raise HTTPException(404, str(err)) from None
        except LeaseError as err:
            raise HTTPException(409, str(err)) from None

    return router
