"""The coordinator's REST API: how to join the run, and what the swarm looks like now.

Every response is built from the latest view in a ViewHolder (see coordinator.view) or from the
run's History (coordinator.history, SQLite); no handler touches the DHT, so a slow or partitioned
DHT never stalls the API.
"""

from __future__ import annotations

import base64
import math
import statistics
import time
from pathlib import Path
from typing import Annotated, Literal

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field

from coordinator.api_control import ErrorDetail, control_router, token_matches
from coordinator.api_data import data_router
from coordinator.api_history import history_router
from coordinator.api_invites import invites_router
from coordinator.api_peers import peers_router
from coordinator.api_reachability import reachability_router
from coordinator.api_speedtest import speedtest_router
from coordinator.ca import RunCA
from coordinator.contributions import Contributions
from coordinator.control import OperatorControl
from coordinator.history import History, point_of
from coordinator.invites import InviteError, InviteRefused, Invites, UnknownInvite
from coordinator.leases import ShardLeases
from coordinator.metrics import metrics_router
from coordinator.view import ViewHolder
from swarm import __version__
from swarm.config import RunConfig
from swarm.identity import CertificateError, identity_of, load_public_key, peer_id_of
from swarm.rebalance import best_assignment
from swarm.records import PeerRecord, SwarmView, TrainerRecord
from swarm.tokenizer import HFTokenizer, load_tokenizer

STATIC_DIR = Path(__file__).parent / "static"  # the dashboard: index.html, app.js, chart.js, style.css
join_bearer = HTTPBearer(
    auto_error=False,
    scheme_name="JoinToken",
    description="the token given to `swarm coordinator --join-token`, or an invite's (`swarm coordinator invite`)",
)


class JoinInfo(BaseModel):
    """What the coordinator knows about itself at start-up."""

    initial_peers: list[str]
    relay: str | None = None  # HOST:PORT of this coordinator's relay (swarm/relay.py); None: it runs none


class CertificateRequest(BaseModel):
    """A joiner's DHT identity, to be certified as a member of the run."""

    public_key: str = Field(
        min_length=1, max_length=8192, description="the public half of the joiner's DHT key (RSA, PEM)"
    )
    role: Literal["peer", "trainer"] = Field(description="what the joiner will do in the run")


class CertificateResponse(BaseModel):
    certificate: str = Field(description="PEM: the joiner's member certificate, signed by the run CA")
    ca: str = Field(description="PEM: the run CA's certificate, the root every member checks others against")
    peer_id: str = Field(description="the peer id the certificate names, derived from the key")
    expires: float = Field(description="unix time after which the certificate is no longer valid")
    dht_token: str = Field(description="base64: the joiner's DHT access token (hivemind's AccessToken)")


class JoinResponse(BaseModel):
    run_id: str
    config: RunConfig = Field(description="the run configuration; parse it with swarm.config.parse_config")
    initial_peers: list[str] = Field(description="multiaddrs of the coordinator's DHT node, to bootstrap from")
    version: str
    tokenizer_sha256: str | None = Field(
        None,
        description="sha256 of the run's tokenizer.json, served at /api/v1/tokenizer; "
        "None: the byte tokenizer, nothing to download",
    )
    relay: str | None = Field(None, description="HOST:PORT of the coordinator's relay for unreachable peers")


class StageState(BaseModel):
    index: int
    layers: tuple[int, int] = Field(description="the transformer blocks [start, stop) this stage owns")
    peers: list[PeerRecord]
    online: int = Field(description="peers in state 'online'")
    joining: int = Field(description="peers in state 'joining'")
    leaving: int = Field(description="peers in state 'leaving'")
    throughput: float = Field(description="total samples/s of the online peers")
    median_throughput: float = Field(description="the median samples/s of the online peers (0 with none)")
    queue: int = Field(description="requests waiting at the online peers, all together")
    queue_per_peer: float = Field(description="queue / online (0 with none online): the stage's queue pressure")
    bottleneck: bool = Field(description="lowest total throughput of all stages (every stage tied for it)")
    most_queue: bool = Field(description="the longest queue per online peer of all stages, when any queues")


class StateResponse(BaseModel):
    run_id: str
    num_stages: int
    stages: list[StageState]
    peers_online: int = Field(description="peers online on any stage")
    bottleneck_throughput: float = Field(
        description="total samples/s of the slowest stage: what the pipeline can do with today's placement"
    )
    policy_throughput: float = Field(
        description="the slowest stage's samples/s were the same online peers where the rebalancing policy's best "
        "assignment puts them (swarm.rebalance.best_assignment): what the peers' moves aim at"
    )
    balanced_throughput: float = Field(
        description="every stage's samples/s were the online peers' total spread evenly over the stages (total / "
        "stages): the pipeline perfectly balanced, what its imbalance costs"
    )
    trainers: list[TrainerRecord]
    global_step: int = Field(description="most steps of any trainer; with no trainer, of any online peer; else 0")
    loss: float | None = Field(description="the last loss of the trainer with the most steps")
    val_loss: float | None = Field(description="the last validation loss of that trainer")
    tokens_per_s: float = Field(description="all trainers together")
    paused: bool = Field(description="whether the operator paused training (the control record as last read)")
    read_at: float = Field(description="unix time the view was read from the DHT")
    age_s: float = Field(description="seconds since read_at")


class Health(BaseModel):
    ok: bool


def policy_throughput(view: SwarmView) -> float:
    """The lowest stage total were the online peers where the rebalancing policy's best assignment puts
    them, each weighed by the samples/s it announces (what the stage totals add up)."""
    online = [p for k in range(len(view.stages)) for p in view.online(k)]
    if not view.stages:
        return 0.0
    speeds = [p.throughput for p in online]
    best = best_assignment(speeds, [p.stage for p in online], len(view.stages))
    totals = [0.0] * len(view.stages)
    for x, k in zip(speeds, best, strict=True):
        totals[k] += x
    return min(totals)


def build_state(
    run: RunConfig, view: SwarmView, now: float | None = None, paused: bool = False, policy: float | None = None
) -> StateResponse:
    """`policy`: `policy_throughput(view)`, when the caller has it already (it is costly for a few peers,
    where best_assignment tries every placement)."""
    throughputs = view.stage_throughputs()
    lowest = min(throughputs) if throughputs else 0.0
    pressure = [_queue_per_peer(view.online(k)) for k in range(len(view.stages))]
    most = max(pressure, default=0.0)
    stages = []
    for k, peers in enumerate(view.stages):
        layers = run.stage_layers(k)
        online = view.online(k)
        stages.append(
            StageState(
                index=k,
                layers=(layers.start, layers.stop),
                peers=peers,
                online=len(online),
                joining=sum(p.state == "joining" for p in peers),
                leaving=sum(p.state == "leaving" for p in peers),
                throughput=throughputs[k],
                median_throughput=statistics.median(p.throughput for p in online) if online else 0.0,
                queue=sum(p.queue for p in online),
                queue_per_peer=pressure[k],
                bottleneck=math.isclose(throughputs[k], lowest, rel_tol=1e-9, abs_tol=1e-9),
                most_queue=most > 0 and math.isclose(pressure[k], most, rel_tol=1e-9),
            )
        )
    now = time.time() if now is None else now
    progress = point_of(view)
    return StateResponse(
        run_id=run.run_id,
        num_stages=run.stages.count,
        stages=stages,
        peers_online=sum(s.online for s in stages),
        bottleneck_throughput=lowest,
        policy_throughput=policy_throughput(view) if policy is None else policy,
        balanced_throughput=sum(throughputs) / len(throughputs) if throughputs else 0.0,
        trainers=view.trainers,
        global_step=progress.step,
        loss=progress.loss,
        val_loss=progress.val_loss,
        tokens_per_s=progress.tokens_per_s,
        paused=paused,
        read_at=view.read_at,
        age_s=max(0.0, now - view.read_at),
    )


def _queue_per_peer(online: list[PeerRecord]) -> float:
    return sum(p.queue for p in online) / len(online) if online else 0.0


def without_dht_addresses(state: StateResponse) -> StateResponse:
    """The state as anyone may read it: no peer's DHT addresses (a way into the run's DHT)."""
    stages = [
        stage.model_copy(update={"peers": [p.model_copy(update={"dht_addrs": []}) for p in stage.peers]})
        for stage in state.stages
    ]
    return state.model_copy(update={"stages": stages})


def create_app(
    run: RunConfig,
    view_holder: ViewHolder,
    join_info: JoinInfo,
    control: OperatorControl | None = None,
    history: History | None = None,
    ca: RunCA | None = None,
    leases: ShardLeases | None = None,
    contributions: Contributions | None = None,
) -> FastAPI:
    """The coordinator's HTTP app; without a `history` store it keeps the history in memory only, and
    without `contributions` (the peers' tallies, a listener of `view_holder` the caller registers) it
    knows of no peer's contribution. When
    the control's invites guard the run (a join token, or invite-only), /api/v1/join,
    /api/v1/certificate and the shard leases answer only requests that carry a valid token (reading
    the swarm stays open). Without `control`, an open run that nobody controls; without `leases`, no
    data endpoints (trainers then read every shard themselves)."""
    history = history if history is not None else History(Path(":memory:"))
    contributions = contributions if contributions is not None else Contributions(Path(":memory:"))
    invites = control.invites if control is not None else Invites(None)
    app = FastAPI(
        title=f"swarm coordinator: run {run.run_id}",
        version=__version__,
        description="Join a SWARM training run and watch its pipeline stages.",
    )

    def joiner(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(join_bearer)]) -> str:
        """The name of the invite whose token the request carries."""
        try:
            return invites.admit(credentials.credentials if credentials is not None else "")
        except UnknownInvite:
            raise HTTPException(
                401,
                "missing or wrong join token: this run needs the join token its operator gave out "
                "(send 'Authorization: Bearer TOKEN'; swarm peer --join-token, or $SWARM_JOIN_TOKEN)",
                headers={"WWW-Authenticate": "Bearer"},
            ) from None
        except InviteRefused as err:
            raise HTTPException(403, str(err)) from None

    def anyone() -> None:
        """An open run's joiner: under no invite."""

    # An open run declares no security on /api/v1/join, so its schema says what it does.
    guarded = invites.guarded
    admitted = joiner if guarded else anyone
    refused = {401: {"model": ErrorDetail}, 403: {"model": ErrorDetail}} if guarded else {}

    # Read once: what is served is what was hashed, whatever happens to the file later.
    tokenizer = load_tokenizer(run.data.tokenizer)
    served = tokenizer if isinstance(tokenizer, HFTokenizer) else None

    @app.get(
        "/api/v1/join",
        response_model=JoinResponse,
        responses=refused,
        dependencies=[Depends(admitted)],
        summary="How to join this run",
    )
    def join() -> JoinResponse:
        return JoinResponse(
            run_id=run.run_id,
            config=run,
            initial_peers=join_info.initial_peers,
            version=__version__,
            tokenizer_sha256=served.digest if served is not None else None,
            relay=join_info.relay,
        )

    @app.get(
        "/api/v1/tokenizer",
        response_class=Response,
        responses={200: {"content": {"application/json": {}}}, 404: {"model": ErrorDetail}, **refused},
        dependencies=[Depends(admitted)],
        summary="The run's tokenizer.json (its sha256 is in the join answer)",
    )
    def tokenizer_file() -> Response:
        if served is None:
            raise HTTPException(404, "this run uses the byte tokenizer: there is no tokenizer file")
        return Response(served.data, media_type="application/json")

    if ca is not None:

        @app.post(
            "/api/v1/certificate",
            response_model=CertificateResponse,
            responses={422: {"model": ErrorDetail}, 403: {"model": ErrorDetail}, **refused},
            summary="Certify a joiner's DHT identity as a member of this run (counted against its invite)",
        )
        def certificate(
            request: CertificateRequest,
            # A default, not Annotated: this module's annotations are strings, and `admitted` is local.
            invite: str | None = Depends(admitted),  # noqa: B008
        ) -> CertificateResponse:
            try:
                key = load_public_key(request.public_key)
                invites.count(invite, peer_id_of(key))  # a revoked peer, or one identity too many: refused
                issued = ca.issue(key, request.role)
            except CertificateError as err:
                raise HTTPException(422, str(err)) from None
            except InviteRefused as err:
                raise HTTPException(403, str(err)) from None
            member = identity_of(issued.certificate, ca.cert, run.run_id)
            return CertificateResponse(
                certificate=issued.certificate,
                ca=issued.ca,
                peer_id=member.peer_id,
                expires=issued.expires,
                dht_token=base64.b64encode(issued.dht_token).decode(),
            )

    def insider(request: Request) -> bool:
        # The operator, or a joiner with the run's token: who may see where the peers' DHT nodes listen.
        # Read from the header itself: as a security dependency, the token would look required to
        # every client of the API, while anyone may read the state.
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme != "Bearer" or not given:
            return False
        if (
            control is not None
            and control.token
            and token_matches(HTTPAuthorizationCredentials(scheme=scheme, credentials=given), control.token)
        ):
            return True
        try:
            invites.admit(given)
        except InviteError:
            return False
        return True

    @app.get(
        "/api/v1/state",
        response_model=StateResponse,
        summary="The swarm as last read from the DHT",
        description="The peers' DHT addresses are listed only to the operator and to holders of the join token.",
    )
    def state(full: bool = Depends(insider)) -> StateResponse:  # noqa: B008 (a local dependency)
        current = current_state()
        return current if full else without_dht_addresses(current)

    last: list[tuple[SwarmView | None, float]] = [(None, 0.0)]  # a view and its policy throughput

    def current_state() -> StateResponse:
        view = view_holder.get()
        seen, policy = last[0]
        if seen is not view:  # once per view, not per request
            policy = policy_throughput(view)
            last[0] = (view, policy)
        return build_state(run, view, paused=view_holder.control().paused, policy=policy)

    app.include_router(history_router(history))  # /api/v1/history, /api/v1/events (coordinator.api_history)
    app.include_router(peers_router(view_holder, history, contributions))  # /api/v1/peers (coordinator.api_peers)
    app.include_router(metrics_router(current_state))  # /metrics (coordinator.metrics)

    app.include_router(control_router(view_holder, control))  # operator-only (coordinator.api_control)
    app.include_router(invites_router(invites, control))  # /api/v1/invites (coordinator.api_invites)
    if leases is not None:
        app.include_router(data_router(leases, admitted, refused))  # /api/v1/data (coordinator.api_data)
    app.include_router(speedtest_router(admitted, refused))  # /api/v1/speedtest (coordinator.api_speedtest)
    app.include_router(
        reachability_router(admitted, refused, join_info.relay, dialled=view_holder.read_soon)
    )  # /api/v1/reachability (coordinator.api_reachability)

    # The live dashboard: static files shipped in the package, polling the API above.
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/", include_in_schema=False)
    def dashboard() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html")

    @app.get("/healthz", response_model=Health, summary="Liveness")
    def healthz() -> Health:
        return Health(ok=True)

    return app
