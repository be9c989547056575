"""The coordinator's link test: how fast a joining peer's link carries bytes each way.

A peer times a download (`GET /api/v1/speedtest?bytes=N`) and an upload (`POST /api/v1/speedtest`)
of a few MiB against the coordinator, as Petals' servers time a speed test, and announces as its
capacity what its device computes with the time its link takes for a sample's activations and
gradients added (peer/throughput.py `capacity`): a fast GPU behind a slow home uplink is weighed as
what it can serve through it. Both want what joining wants (the join token in a guarded run): an
outsider cannot make the coordinator send bytes. Each is bounded by MAX_BYTES; a larger upload is
refused as soon as it passes the bound, before the rest is read.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations at runtime, and
# the dependency they use is local to the coordinator's app.
import os
from collections.abc import Callable
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response
from pydantic import BaseModel

from coordinator.api_control import ErrorDetail

MAX_BYTES = 8 * 2**20


class Received(BaseModel):
    received: int  # bytes of the upload, as read


def speedtest_router(admitted: Callable, refused: dict) -> APIRouter:
    router = APIRouter(dependencies=[Depends(admitted)])

    @router.get(
        "/api/v1/speedtest",
        response_class=Response,
        responses={200: {"content": {"application/octet-stream": {}}}, **refused},
        summary="Random bytes, for a joining peer to time its downlink",
    )
    def download(n: Annotated[int, Query(alias="bytes", ge=1, le=MAX_BYTES)]) -> Response:
        return Response(os.urandom(n), media_type="application/octet-stream")

    @router.post(
        "/api/v1/speedtest",
        response_model=Received,
        responses={413: {"model": ErrorDetail}, **refused},
        summary="Take bytes and count them, for a joining peer to time its uplink",
    )
    async def upload(request: Request) -> Received:
        received = 0
        async for chunk in request.stream():
            received += len(chunk)
            if received > MAX_BYTES:
                raise HTTPException(413, f"a link test uploads at most {MAX_BYTES} bytes")
        return Received(received=received)

    return router
