"""Operator-only endpoints of the coordinator: pause and resume training, remove a peer.

Every call carries the operator's token (`Authorization: Bearer TOKEN`, the token given to
`swarm coordinator --token`). A missing or wrong token gets 401 and changes nothing; a coordinator
started without a token answers 403, so that control cannot be opened by accident. The handlers
only record the decision in the OperatorControl (coordinator.control), which stores it in the DHT.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations at runtime, and
# the dependency alias they use is local to control_router.
import hmac
from collections.abc import Callable
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field

from coordinator.control import OperatorControl
from coordinator.view import ViewHolder

bearer = HTTPBearer(auto_error=False, description="the token given to `swarm coordinator --token`")


class PauseState(BaseModel):
    paused: bool = Field(description="whether trainers hold off starting their next global step")


class Removed(BaseModel):
    removed: str = Field(description="the peer id of the peer told to leave")


class ErrorDetail(BaseModel):
    detail: str


def token_matches(credentials: HTTPAuthorizationCredentials | None, token: str) -> bool:
    """Whether the request's bearer token is `token` (compared in constant time)."""
    given = credentials.credentials.encode() if credentials is not None else b""
    return hmac.compare_digest(given, token.encode())


# What an operator's endpoint may answer besides its own responses.
REFUSED: dict[int | str, dict] = {401: {"model": ErrorDetail}, 403: {"model": ErrorDetail}}


def operator_of(control: OperatorControl | None) -> Callable[..., OperatorControl]:
    """The dependency that lets only the operator through; `control` None (or without a token)
    disables every endpoint that uses it (403)."""

    def operator(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> OperatorControl:
        if control is None or control.token is None:
            raise HTTPException(403, "control is disabled: start the coordinator with --token")
        if not token_matches(credentials, control.token):
            raise HTTPException(
                401,
                "missing or wrong operator token: send 'Authorization: Bearer TOKEN'",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return control

    return operator


def control_router(view_holder: ViewHolder, control: OperatorControl | None) -> APIRouter:
    """The operator's endpoints; `control` None (or without a token) disables them (403)."""
    Operator = Annotated[OperatorControl, Depends(operator_of(control))]
    router = APIRouter(prefix="/api/v1", tags=["operator"], responses=REFUSED)

    @router.post("/control/pause", response_model=PauseState, summary="Pause training after the current step")
    def pause(op: Operator) -> PauseState:
        op.set_paused(True)
        return PauseState(paused=True)

    @router.post("/control/resume", response_model=PauseState, summary="Resume training")
    def resume(op: Operator) -> PauseState:
        op.set_paused(False)
        return PauseState(paused=False)

    @router.post(
        "/peers/{peer_id}/remove",
        response_model=Removed,
        responses={404: {"model": ErrorDetail}},
        summary="Tell a peer to leave the run",
    )
    def remove(peer_id: str, op: Operator) -> Removed:
        view = view_holder.get()
        peer = next((p for stage in view.stages for p in stage if p.peer_id == peer_id), None)
        if peer is None:
            raise HTTPException(404, f"no peer {peer_id!r} in the run (as last read from the DHT)")
        op.remove(peer)
        return Removed(removed=peer_id)

    return router
