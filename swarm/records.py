"""The swarm's DHT records: one module owns the key schema.

Per run and stage, one record per peer under the key `{run_id}/stage/{k}` with subkey = the peer's
DHT peer id; trainers under `{run_id}/trainers`. Records carry an expiration time and are
refreshed every `REFRESH_S`, so a peer that dies vanishes by itself within `TTL_S`.

The operator's word, stored by the coordinator: `{run_id}/control` (is the run paused?), re-stored
every `CONTROL_REFRESH_S` with a time to live of `CONTROL_TTL_S`, so the pause of a coordinator that
died lapses by itself and training goes on; and `{run_id}/removed` with subkey = the peer id of each
peer the operator removed from the run.

Reading is forgiving: a value that does not parse as a record is skipped (and logged), so one
misbehaving peer cannot break everybody's view of the swarm.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import time
from pathlib import Path
from typing import Literal

import hivemind
from hivemind.utils import get_dht_time
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from swarm import __version__

log = logging.getLogger("swarm.records")

REFRESH_S = 4.0  # how often a live peer or trainer re-announces itself
TTL_S = 12.0  # a record not refreshed for this long expires (a killed peer is gone within it)
CONTROL_REFRESH_S = 5.0  # how often the coordinator re-stores the control record
CONTROL_TTL_S = 60.0  # a pause outlives its coordinator by at most this long
REMOVED_TTL_S = 600.0  # a removed peer sees its removal at its next refresh; this is ample

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
    dht_addrs: list[str] = Field(default_factory=list)  # its DHT node's multiaddrs: a restarted coordinator's way in


class TrainerRecord(BaseModel):
    model_config = ConfigDict(extra="ignore")

    trainer_id: str
    public_name: str = ""
    samples: int = Field(0, ge=0)
    steps: int = Field(0, ge=0)
    loss: float | None = None
    val_loss: float | None = None  # the last one measured
    tokens_per_s: float = Field(0.0, ge=0)
    failures: int = Field(0, ge=0)  # calls that failed and were retried on another peer
    bans: int = Field(0, ge=0)  # times a failing peer was banned
    wire_bytes: int = Field(0, ge=0)  # bytes sent and received by its stage calls
    updated: float = 0.0


class ControlState(BaseModel):
    """What the operator decided for the whole run (no record at all reads as running)."""

    model_config = ConfigDict(extra="ignore")

    paused: bool = False
    updated: float = 0.0


class RemovedRecord(BaseModel):
    model_config = ConfigDict(extra="ignore")

    peer_id: str
    updated: float = 0.0


def stage_key(run_id: str, stage: int) -> str:
    return f"{run_id}/stage/{stage}"


def trainers_key(run_id: str) -> str:
    return f"{run_id}/trainers"


def control_key(run_id: str) -> str:
    return f"{run_id}/control"


def removed_key(run_id: str) -> str:
    return f"{run_id}/removed"


CONTROL_SUBKEY = "coordinator"  # one writer: whichever coordinator of the run stored last


def make_dht(
    initial_peers: list[str] | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    client_mode: bool = False,
    identity_path: Path | None = None,
    announce_host: str | None = None,
) -> hivemind.DHT:
    """A DHT node listening on HOST:PORT (hivemind's default is loopback only). With `identity_path`
    (a private key file, created when missing) the node keeps its peer id across restarts, so on
    the same port it keeps its multiaddrs too. With `announce_host` (the address others reach this
    machine at: a public IP or name, a forwarded router's) the node tells others only that address,
    not its interfaces' (which, behind NAT or in a container, nobody else can reach); it needs a
    known port, so port 0 becomes a free port picked here."""
    maddrs = [f"/ip4/{host}/tcp/{port}"]
    extra: dict = {"identity_path": str(identity_path)} if identity_path is not None else {}
    if announce_host:
        if port == 0:
            port = free_port(host)
            maddrs = [f"/ip4/{host}/tcp/{port}"]
        extra["announce_maddrs"] = [host_maddr(announce_host, port)]
    return hivemind.DHT(
        initial_peers=initial_peers or None,
        host_maddrs=maddrs,
        client_mode=client_mode,
        start=True,
        await_ready=True,
        **extra,
    )


def host_maddr(host: str, port: int) -> str:
    """The TCP multiaddr of HOST (an IPv4 address, an IPv6 address or a DNS name) and PORT."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return f"/dns/{host}/tcp/{port}"
    return f"/ip{ip.version}/{host}/tcp/{port}"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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


def announce_control(
    dht: hivemind.DHT, run_id: str, state: ControlState, ttl: float = CONTROL_TTL_S, timeout: float | None = None
) -> bool:
    return _store(dht, control_key(run_id), CONTROL_SUBKEY, state.model_dump(), ttl, timeout)


def announce_removed(
    dht: hivemind.DHT, run_id: str, peer_id: str, ttl: float = REMOVED_TTL_S, timeout: float | None = None
) -> bool:
    return _store(dht, removed_key(run_id), peer_id, RemovedRecord(peer_id=peer_id).model_dump(), ttl, timeout)


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


def read_control(dht: hivemind.DHT, run_id: str) -> ControlState:
    """The run's control record; when there is none (never stored, or its coordinator has been gone
    for CONTROL_TTL_S) the run is not paused."""
    return max(_read(dht, control_key(run_id), ControlState), key=lambda c: c.updated, default=ControlState())


def read_removed(dht: hivemind.DHT, run_id: str) -> set[str]:
    """Peer ids the operator removed from the run."""
    return {r.peer_id for r in _read(dht, removed_key(run_id), RemovedRecord)}


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
