"""Can the swarm reach a joining peer? The coordinator dials it back.

A peer that serves tells the coordinator where it listens (`POST /api/v1/reachability`: its stage
service's HOST:PORT and its DHT node's multiaddrs) and the coordinator opens a TCP connection to
each, as a trainer or another peer would. A volunteer behind a home router that forwards no port
dials out fine, is listed online, and yet nobody can reach it: told `unreachable`, the peer says
what to change. The coordinator dials only the address the request came from (a member cannot make
it knock on other machines), at most MAX_ADDRS addresses, each for at most DIAL_TIMEOUT_S; it wants
what joining wants (the join token in a guarded run).
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations at runtime, and
# the dependency they use is local to the coordinator's app.
import ipaddress
import re
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

from fastapi import APIRouter, Depends, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field

from coordinator.api_control import ErrorDetail

MAX_ADDRS = 8
DIAL_TIMEOUT_S = 3.0
HOST_PORT = r"^[^\s/]{1,253}:\d{1,5}$"
MADDR = re.compile(r"^/(ip4|ip6)/([^/]+)/tcp/(\d{1,5})(/.*)?$")

Reach = Literal["direct", "unreachable"]


class ReachabilityRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    address: str = Field(pattern=HOST_PORT, max_length=300, description="the stage service's HOST:PORT")
    dht_addrs: list[str] = Field(
        default_factory=list, max_length=MAX_ADDRS, description="the DHT node's multiaddrs (/ip4/HOST/tcp/PORT/...)"
    )


class Dial(BaseModel):
    target: str  # HOST:PORT dialled
    reach: Reach
    error: str = ""  # why the connection failed


class ReachabilityResponse(BaseModel):
    seen_from: str = Field(description="the address the request came from: the only one dialled")
    stage: Dial
    dht: list[Dial] = Field(description="one per multiaddr on the address the request came from")
    reach: Reach = Field(description="direct: the stage service and a DHT address (if any) answered")
    relay: str | None = Field(None, description="HOST:PORT of a relay an unreachable peer may serve through")


def dial(host: str, port: int) -> Dial:
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        with socket.create_connection((host, port), timeout=DIAL_TIMEOUT_S):
            return Dial(target=target, reach="direct")
    except OSError as err:
        return Dial(target=target, reach="unreachable", error=str(err) or type(err).__name__)


def split_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def same_host(a: str, b: str) -> bool:
    """Whether `a` is the machine `b` is: the same IP, or both loopback (this machine)."""
    try:
        x, y = ipaddress.ip_address(a), ipaddress.ip_address(b)
    except ValueError:
        return False
    return x == y or (x.is_loopback and y.is_loopback)


def reachability_router(
    admitted: Callable, refused: dict, relay: str | None = None, dialled: Callable[[], None] = lambda: None
) -> APIRouter:
    """`dialled`: called once a peer was dialled back. A peer asks once it announced itself online, so
    the coordinator reads the swarm again then, and lists it online at once rather than up to
    READ_EVERY_S later."""
    router = APIRouter(dependencies=[Depends(admitted)])

    @router.post(
        "/api/v1/reachability",
        response_model=ReachabilityResponse,
        responses={422: {"model": ErrorDetail}, **refused},
        summary="Dial a serving peer back: can the swarm reach it?",
    )
    def reachability(body: ReachabilityRequest, request: Request) -> ReachabilityResponse:
        seen = request.client.host if request.client else ""
        host, port = split_host_port(body.address)
        if not 0 < port < 65536:
            raise HTTPException(422, f"address {body.address!r}: port {port} is not 1..65535")
        if not same_host(host, seen):
            raise HTTPException(
                422,
                f"address {body.address!r}: the coordinator dials back only the address the request comes from "
                f"({seen}); a peer behind a router announces its public address with --announce-host",
            )
        targets = [(host, port)]
        for maddr in body.dht_addrs:
            m = MADDR.match(maddr)
            if m is None:
                raise HTTPException(422, f"dht_addrs: {maddr!r} is not /ip4|ip6/HOST/tcp/PORT[/...]")
            if same_host(m.group(2), seen) and 0 < int(m.group(3)) < 65536:
                targets.append((m.group(2), int(m.group(3))))
        with ThreadPoolExecutor(len(targets)) as pool:
            dials = list(pool.map(lambda t: dial(*t), targets))
        stage, dht = dials[0], dials[1:]
        direct = stage.reach == "direct" and (not dht or any(d.reach == "direct" for d in dht))
        reach = "direct" if direct else "unreachable"
        dialled()
        return ReachabilityResponse(seen_from=seen, stage=stage, dht=dht, reach=reach, relay=relay)

    return router
