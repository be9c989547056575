"""The swarm's DHT records: one module owns the key schema.

Per run and stage, one record per peer under the key `{run_id}/stage/{k}` with subkey = the peer's
DHT peer id; trainers under `{run_id}/trainers`. Records carry an expiration time and are
refreshed every `REFRESH_S`, so a peer that dies vanishes by itself within `TTL_S`.

Reading is forgiving: a value that does not parse as a record is skipped (and logged), so one
misbehaving peer cannot break everybody's view of the swarm.
"""

from __future__ import annotations

import logging
import time
from typing import Literal

import hivemind
from hivemind.utils import get_dht_time
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from swarm import __version__

log = logging.getLogger("swarm.records")

REFRESH_S = 4.0  # how often a live peer or trainer re-announces itself
TTL_S = 12.0  # a record not refreshed for this long expires (a killed peer is gone within it)

PeerState = Literal["joining", "online", "leaving"]


class PeerRecord(BaseModel):
    model_config = ConfigDict(extra="ignore")

    peer_id: str
    stage: int = Field(ge=0)
    address: str  # HOST:PORT of its gRPC stage service
    public_name: str = ""
    device: str = ""
    throughput: float = Field(0.0, ge=0)  # samples/s of forward + backward on this stage
    queue: int = Field(0, ge=0)
    state: PeerState = "joining"
    version: str = __version__
    started: float = 0.0
    updated: float = 0.0
    samples_served: int = Field(0, ge=0)
    optimizer_steps: int = Field(0, ge=0)
    weights_from: str = ""  # where the stage's state came from: live peers, the seeded init, a checkpoint
    moving_to: int | None = Field(None, ge=0)  # set while leaving this stage for another one


class TrainerRecord(BaseModel):
    model_config = ConfigDict(extra="ignore")

    trainer_id: str
    public_name: str = ""
    samples: int = Field(0, ge=0)
    steps: int = Field(0, ge=0)
    loss: float | None = None
    tokens_per_s: float = Field(0.0, ge=0)
    updated: float = 0.0


def stage_key(run_id: str, stage: int) -> str:
    return f"{run_id}/stage/{stage}"


def trainers_key(run_id: str) -> str:
    return f"{run_id}/trainers"


def make_dht(
    initial_peers: list[str] | None = None, host: str = "127.0.0.1", port: int = 0, client_mode: bool = False
) -> hivemind.DHT:
    """A DHT node listening on HOST:PORT (hivemind's default is loopback only)."""
    maddrs = [f"/ip4/{host}/tcp/{port}"]
    return hivemind.DHT(
        initial_peers=initial_peers or None, host_maddrs=maddrs, client_mode=client_mode, start=True, await_ready=True
    )


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    return [str(m) for m in dht.get_visible_maddrs()]


def _store(dht: hivemind.DHT, key: str, subkey: str, value: dict, ttl: float, timeout: float | None) -> bool:
    """Store a record; with `timeout`, give up (False) when the DHT does not confirm in time."""
    now = get_dht_time()
    future = dht.store(key, dict(value, updated=now), expiration_time=now + ttl, subkey=subkey, return_future=True)
    try:
        return bool(future.result(timeout=timeout))
    except Exception:  # a timeout, or the DHT process is gone (e.g. Ctrl-C reached the whole group)
        return False


def announce_peer(
    dht: hivemind.DHT, run_id: str, record: PeerRecord, ttl: float = TTL_S, timeout: float | None = None
) -> bool:
    return _store(dht, stage_key(run_id, record.stage), record.peer_id, record.model_dump(), ttl, timeout)


def announce_trainer(
    dht: hivemind.DHT, run_id: str, record: TrainerRecord, ttl: float = TTL_S, timeout: float | None = None
) -> bool:
    return _store(dht, trainers_key(run_id), record.trainer_id, record.model_dump(), ttl, timeout)


def shutdown_dht(dht: hivemind.DHT) -> None:
    """Stop the DHT process and its p2pd. A signal sent to the whole process group (Ctrl-C in a
    terminal) may have ended them already; then there is nothing to ask, only to reap."""
    if dht.is_alive():
        dht.shutdown()
    else:
        dht.join(timeout=3)


def _read(dht: hivemind.DHT, key: str, model: type[BaseModel]) -> list:
    found = dht.get(key, latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    records = []
    for subkey, item in found.value.items():
        try:
            records.append(model.model_validate(item.value))
        except (ValidationError, AttributeError, TypeError) as err:
            log.warning("ignoring a malformed record under %s/%s: %s", key, subkey, err)
    return records


def read_stage(dht: hivemind.DHT, run_id: str, stage: int) -> list[PeerRecord]:
    return [r for r in _read(dht, stage_key(run_id, stage), PeerRecord) if r.stage == stage]


def read_trainers(dht: hivemind.DHT, run_id: str) -> list[TrainerRecord]:
    return _read(dht, trainers_key(run_id), TrainerRecord)


class SwarmView(BaseModel):
    """Everything the DHT says about one run at one moment."""

    stages: list[list[PeerRecord]]
    trainers: list[TrainerRecord]
    read_at: float

    def online(self, stage: int) -> list[PeerRecord]:
        return [p for p in self.stages[stage] if p.state == "online"]

    def stage_throughputs(self) -> list[float]:
        return [sum(p.throughput for p in self.online(k)) for k in range(len(self.stages))]


def read_swarm(dht: hivemind.DHT, run_id: str, num_stages: int) -> SwarmView:
    return SwarmView(
        stages=[read_stage(dht, run_id, k) for k in range(num_stages)],
        trainers=read_trainers(dht, run_id),
        read_at=time.time(),
    )
