"""The coordinator's invite endpoints: mint and revoke (the operator's), and the public listing.

Minting answers the invite's token, the only time anyone sees it (coordinator.invites keeps its
hash). The listing, which the dashboard polls, names each invite with its identity count, limit,
expiry and whether it is revoked; never a token.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations at runtime, and
# the dependency alias they use is local to invites_router.
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from coordinator.api_control import REFUSED, ErrorDetail, operator_of
from coordinator.control import OperatorControl
from coordinator.invites import InviteConflict, InviteInfo, InviteName, Invites, UnknownInvite

MAX_PEERS = 1_000_000  # far above any run; keeps the number a number
MAX_EXPIRES_S = 10 * 365 * 86400.0


class InviteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: InviteName = Field(description="whom the invite is for: 1 to 64 letters, digits and ._-, unique in the run")
    max_peers: int | None = Field(
        default=None, ge=1, le=MAX_PEERS, description="the most peer identities it may certify (default: no limit)"
    )
    expires_s: float | None = Field(
        default=None, gt=0, le=MAX_EXPIRES_S, description="seconds from now until it admits no one (default: never)"
    )


class MintedInvite(BaseModel):
    name: str
    token: str = Field(description="the invite's join token: shown this once, never again")
    max_peers: int | None
    expires: float | None = Field(description="unix time after which it admits no one (null: never)")
    guarded: bool = Field(description="whether the run wants a token to join (false: an open run, anyone joins)")


class InviteList(BaseModel):
    guarded: bool = Field(description="whether the run wants a token to join (false: an open run, anyone joins)")
    invites: list[InviteInfo]


def invites_router(invites: Invites, control: OperatorControl | None) -> APIRouter:
    """/api/v1/invites: the listing for anyone, minting and revoking for the operator only."""
    Operator = Annotated[OperatorControl, Depends(operator_of(control))]
    router = APIRouter(prefix="/api/v1", tags=["invites"])

    @router.get("/invites", response_model=InviteList, summary="The run's invites (never their tokens)")
    def listing() -> InviteList:
        return InviteList(guarded=invites.guarded, invites=invites.listing())

    @router.post(
        "/invites",
        response_model=MintedInvite,
        status_code=201,
        responses={**REFUSED, 409: {"model": ErrorDetail}},
        summary="Mint an invite: its token is in this answer only",
    )
    def mint(request: InviteRequest, op: Operator) -> MintedInvite:
        try:
            token, info = op.mint_invite(request.name, request.max_peers, request.expires_s)
        except InviteConflict as err:
            raise HTTPException(409, str(err)) from None
        return MintedInvite(
            name=info.name, token=token, max_peers=info.max_peers, expires=info.expires, guarded=invites.guarded
        )

    @router.post(
        "/invites/{name}/revoke",
        response_model=InviteInfo,
        responses={**REFUSED, 404: {"model": ErrorDetail}, 409: {"model": ErrorDetail}},
        summary="Revoke an invite and every peer identity certified under it",
    )
    def revoke(name: str, op: Operator) -> InviteInfo:
        try:
            return op.revoke_invite(name)
        except UnknownInvite as err:
            raise HTTPException(404, str(err)) from None
        except InviteConflict as err:
            raise HTTPException(409, str(err)) from None

    return router
