"""The coordinator's REST API: how to join the run, and what the swarm looks like now.

Every response is built from the latest view in a ViewHolder (see coordinator.view); no handler
touches the DHT, so a slow or partitioned DHT never stalls the API.
"""

from __future__ import annotations

import math
import time

from fastapi import FastAPI
from pydantic import BaseModel, Field

from coordinator.view import ViewHolder
from swarm import __version__
from swarm.config import RunConfig
from swarm.records import PeerRecord, SwarmView, TrainerRecord


class JoinInfo(BaseModel):
    """What the coordinator knows about itself at start-up."""

    initial_peers: list[str]


class JoinResponse(BaseModel):
    run_id: str
    config: RunConfig = Field(description="the run configuration; parse it with swarm.config.parse_config")
    initial_peers: list[str] = Field(description="multiaddrs of the coordinator's DHT node, to bootstrap from")
    version: str


class StageState(BaseModel):
    index: int
    layers: tuple[int, int] = Field(description="the transformer blocks [start, stop) this stage owns")
    peers: list[PeerRecord]
    online: int = Field(description="peers in state 'online'")
    throughput: float = Field(description="total samples/s of the online peers")
    bottleneck: bool = Field(description="lowest total throughput of all stages (every stage tied for it)")


class StateResponse(BaseModel):
    run_id: str
    num_stages: int
    stages: list[StageState]
    trainers: list[TrainerRecord]
    read_at: float = Field(description="unix time the view was read from the DHT")
    age_s: float = Field(description="seconds since read_at")


class Health(BaseModel):
    ok: bool


def build_state(run: RunConfig, view: SwarmView, now: float | None = None) -> StateResponse:
    throughputs = view.stage_throughputs()
    lowest = min(throughputs) if throughputs else 0.0
    stages = []
    for k, peers in enumerate(view.stages):
        layers = run.stage_layers(k)
        stages.append(
            StageState(
                index=k,
                layers=(layers.start, layers.stop),
                peers=peers,
                online=len(view.online(k)),
                throughput=throughputs[k],
                bottleneck=math.isclose(throughputs[k], lowest, rel_tol=1e-9, abs_tol=1e-9),
            )
        )
    now = time.time() if now is None else now
    return StateResponse(
        run_id=run.run_id,
        num_stages=run.stages.count,
        stages=stages,
        trainers=view.trainers,
        read_at=view.read_at,
        age_s=max(0.0, now - view.read_at),
    )


def create_app(run: RunConfig, view_holder: ViewHolder, join_info: JoinInfo) -> FastAPI:
    app = FastAPI(
        title=f"swarm coordinator: run {run.run_id}",
        version=__version__,
        description="Join a SWARM training run and watch its pipeline stages.",
    )

    @app.get("/api/v1/join", response_model=JoinResponse, summary="How to join this run")
    def join() -> JoinResponse:
        return JoinResponse(run_id=run.run_id, config=run, initial_peers=join_info.initial_peers, version=__version__)

    @app.get("/api/v1/state", response_model=StateResponse, summary="The swarm as last read from the DHT")
    def state() -> StateResponse:
        return build_state(run, view_holder.get())

    @app.get("/healthz", response_model=Health, summary="Liveness")
    def healthz() -> Health:
        return Health(ok=True)

    return app
