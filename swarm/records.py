"""The swarm's DHT records: one module owns the key schema.

Per run and stage, one record per peer under the key `{run_id}/stage/{k}` with subkey = the peer's
DHT peer id; trainers under `{run_id}/trainers`. Records carry an expiration time and are
refreshed every `REFRESH_S`, so a peer that dies vanishes by itself within `TTL_S`.

The operator's word, stored by the coordinator: `{run_id}/control` (is the run paused?), re-stored
every `CONTROL_REFRESH_S` with a time to live of `CONTROL_TTL_S`, so the pause of a coordinator that
died lapses by itself and training goes on; and `{run_id}/removed` with subkey = the peer id of each
peer the operator removed from the run.

How a stage's replicas agree on a step, each replica its own record under a key per run: at global step
`s`, `{run_id}/gradnorm/{s}` holds each replica's squared gradient norm of its stage (`NormShare`: the
stages clip to one global norm), and `{run_id}/stage/{k}/digests` each replica of stage k's digest of
its weights after its last step (`WeightsDigest`: a replica outvoted by the others has diverged). A
share or a digest counts only when its signer has a record in the stage it speaks for (see below), so
a DHT member that serves no stage cannot forge either. hivemind's Optimizer keeps its own records
under the stage's averaging prefix (`averaging_prefix`), checked by hivemind itself.

Every record is signed by its writer. Its subkey is the id named above followed by the writer's
public key as hivemind's RSASignatureValidator marks it (`[owner:ssh-rsa ...]`), and every DHT node
of the run runs that validator: a node stores, and a reader takes, a record under such a subkey only
when it is signed by the matching private key. So nobody can overwrite another's record, and readers
count only owned subkeys (an unsigned record is ignored) whose id is the one inside the record.

Every DHT node's peer id derives from the key it signs with (libp2p's rule: see `make_dht` and
`signer_peer_id`), so a peer id names exactly one signer. Readers take a peer's stage record only
when its signer's peer id is the record's `peer_id`: a stranger can still publish a stage record
under its own key, but not one that claims an existing peer's id (with another address, to steal
its traffic). Trainer ids are not DHT peer ids (a trainer names itself), so trainer records are
checked for an owner only. The coordinator's peer id is known to all who joined through it (its
multiaddrs), so peers and trainers take the operator's word (the control and removed records) only
from that coordinator.

Reading is forgiving: a value that does not parse as a record is skipped (and logged), so one
misbehaving peer cannot break everybody's view of the swarm.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import ipaddress
import logging
import os
import re
import statistics
import tempfile
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import hivemind
import multihash
from cryptography.hazmat.primitives import serialization
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.auth import AuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.multiaddr import Multiaddr
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, ValidationError

from swarm import __version__
from swarm.dht_calls import cheap_calls
from swarm.net import free_port

log = logging.getLogger(__name__)

REFRESH_S = 4.0  # how often a live peer or trainer re-announces itself
TTL_S = 12.0  # a record not refreshed for this long expires (a killed peer is gone within it)
CONTROL_REFRESH_S = 5.0  # how often the coordinator re-stores the control record
CONTROL_TTL_S = 60.0  # a pause outlives its coordinator by at most this long
REMOVED_TTL_S = 600.0  # a removed peer sees its removal within a revocation poll and a refresh; this is ample
NORM_TTL_S = 120.0  # the stages read a step's norm shares within averaging.sync_timeout_s of it
MAX_STEP = 2**31 - 1  # no honest step count comes near this (a trainer step per second: 68 years)

PeerState = Literal["joining", "online", "leaving"]
Reach = Literal["unknown", "direct", "unreachable", "relayed"]


class PeerRecord(BaseModel):
    model_config = ConfigDict(extra="ignore")

    peer_id: str
    stage: int = Field(ge=0)
    address: str  # HOST:PORT of its gRPC stage service
    public_name: str = ""
    device: str = ""
    throughput: float = Field(0.0, ge=0)  # samples/s of forward + backward on this stage
    capacity: float = Field(0.0, ge=0)  # ... as its device's benchmark measured it (steady; rebalancing weighs it)
    queue: int = Field(0, ge=0)
    state: PeerState = "joining"
    version: str = __version__
    started: float = 0.0
    updated: float = 0.0
    samples_served: int = Field(0, ge=0)
    optimizer_steps: int = Field(0, ge=0, le=MAX_STEP)
    weights_from: str = ""  # where the stage's state came from: live peers, the seeded init, a checkpoint
    moving_to: int | None = Field(None, ge=0)  # set while moving to another stage (online: still serving this one)
    # While an online peer moves: the DHT time by which it expects to serve `moving_to` instead (`SwarmView.routable`)
    ready_at: float | None = Field(None, ge=0, allow_inf_nan=False)
    dht_addrs: list[str] = Field(default_factory=list)  # its DHT node's multiaddrs: a restarted coordinator's way in
    reach: Reach = "unknown"  # whether the coordinator could dial it back, or it serves through a relay
    relay: str = ""  # HOST:PORT of the relay it runs for peers nobody can dial ('': none; swarm/relay.py)


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
    spot_checks: int = Field(0, ge=0)  # forward answers compared with a second peer's (swarm/verify.py)
    spot_disagreements: int = Field(0, ge=0)  # ... that differed beyond the tolerance
    spot_bans: int = Field(0, ge=0)  # bans of peers whose answers two agreeing peers outvoted (so far)
    spot_banned: dict[str, int] = Field(default_factory=dict)  # the peers banned now: peer id -> stage
    # samples whose gradient each peer kept over the trainer's last steps: stage -> peer id -> samples
    # (swarm/receipts.py: what caps a peer's weight in its stage's average)
    served: dict[str, dict[str, NonNegativeInt]] = Field(default_factory=dict)
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


class ReplicaReport(BaseModel):
    """What one replica of a stage says about a global step."""

    model_config = ConfigDict(extra="ignore")

    peer_id: str
    stage: int = Field(ge=0)
    step: int = Field(ge=0, le=MAX_STEP)
    updated: float = 0.0


class NormShare(ReplicaReport):
    """The replica's squared gradient norm of its stage at the step (0.0 for a step it skipped)."""

    squared: float = Field(ge=0, allow_inf_nan=False)  # a negative one would raise in math.sqrt


class WeightsDigest(ReplicaReport):
    """A fingerprint of the replica's weights after the step (peer/replica_check.py: weights_digest)."""

    digest: str = Field(pattern=r"^[0-9a-f]{1,128}$")


def stage_key(run_id: str, stage: int) -> str:
    return f"{run_id}/stage/{stage}"


def trainers_key(run_id: str) -> str:
    return f"{run_id}/trainers"


def control_key(run_id: str) -> str:
    return f"{run_id}/control"


def removed_key(run_id: str) -> str:
    return f"{run_id}/removed"


def norm_key(run_id: str, step: int) -> str:
    return f"{run_id}/gradnorm/{step}"


def digest_key(run_id: str, stage: int) -> str:
    return f"{stage_key(run_id, stage)}/digests"


def averaging_prefix(run_id: str, stage: int) -> str:
    """The run id of the stage's hivemind Optimizer: hivemind's own keys start with it, and it
    forbids dots in them."""
    return f"{run_id}_stage{stage}".replace(".", "_")


def state_holders_key(prefix: str) -> str:
    """hivemind's key under which the state averagers of the Optimizer with run id `prefix` offer the
    stage's state (hivemind's DecentralizedAverager builds it so: there is no public name for it)."""
    return f"{prefix}_state_averager.all_averagers"


CONTROL_SUBKEY = "coordinator"  # one writer: whichever coordinator of the run stored last


# This process's live nodes whose peer id derives from the process-wide key (see `make_dht`).
_process_wide_nodes: weakref.WeakSet = weakref.WeakSet()


def make_dht(
    initial_peers: list[str] | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    client_mode: bool = False,
    identity_path: Path | None = None,
    announce_host: str | None = None,
    record_key: RSAPrivateKey | None = None,
    authorizer: AuthorizerBase | None = None,
    startup_timeout: float = 60.0,
    attempts: int = 2,
) -> hivemind.DHT:
    """A DHT node listening on HOST:PORT (hivemind's default is loopback only) that signs the records
    it stores with `record_key` and refuses records not signed by their owner (see the module
    docstring). Its peer id derives from the key it signs with, so readers can tell that a record
    naming a peer id was signed by that peer (`read_stage`).

    The default key is the process-wide one, the key hivemind's Optimizer signs its progress records
    with: the DHT merges all signature validators into its first one, so the node must sign with
    that same key or the Optimizer's records would go out unsigned. Two live nodes cannot share a
    peer id (hivemind refuses an identity that a reachable peer already holds), so when this process
    already runs a node with the process-wide key, a further node without `record_key` signs with a
    key of its own (a reader's, or a test's second node; it cannot carry an Optimizer).

    With `identity_path` (a private key file, created when missing) the node signs with the file's
    key and keeps its peer id across restarts, so on the same port it keeps its multiaddrs too.
    Otherwise its identity is made here from its key, in a private temporary file that is gone once
    the node has started. With `announce_host` (the address others reach this machine at: a public IP
    or name, a forwarded router's) the node tells others only that address, not its interfaces'
    (which, behind NAT or in a container, nobody else can reach); it needs a known port, so port 0
    becomes a free port picked here. With `authorizer` (swarm/identity.py: `RunAuthorizer`), the node
    answers and takes answers only from members of the run.

    A node that is not ready within `startup_timeout` seconds (on loopback one starts in 1-3 s; its
    p2pd alone may take up to hivemind's 15 s) is ended, with its p2pd, and started again, up to
    `attempts` times in all; then RuntimeError says so. hivemind's own wait has no deadline: once in
    a few thousand starts a node never reports ready, and the caller would wait forever."""
    if startup_timeout <= 0 or attempts < 1:
        raise ValueError(f"make_dht: startup_timeout must be > 0 and attempts >= 1 ({startup_timeout}, {attempts})")
    maddrs = [f"/ip4/{host}/tcp/{port}"]
    extra: dict = {}
    if announce_host:
        if port == 0:
            port = free_port(host)
            maddrs = [f"/ip4/{host}/tcp/{port}"]
        extra["announce_maddrs"] = [host_maddr(announce_host, port)]
    if identity_path is not None:
        if record_key is not None:
            raise ValueError("make_dht: a node with an identity_path signs with its identity's key, not record_key")
        record_key = identity_key(identity_path)
    elif record_key is None:
        record_key = node_key()
    validator = RSASignatureValidator(record_key)
    with tempfile.TemporaryDirectory(prefix="swarm-dht-") as tmp:  # private to this user (mode 0700)
        if identity_path is None:
            identity_path = _write_identity(record_key, Path(tmp) / "identity.key")
            # hivemind checks that no reachable peer holds an identity file's peer id by starting a
            # second p2pd and dialling it through the initial peers: a p2p daemon's start (about 0.8 s
            # of CPU) and a round of dials for every node. A key made here is fresh, or the process-wide
            # one that no live node of this process holds (`node_key`): nobody else can hold it.
            extra["check_if_identity_free"] = False
        for attempt in range(1, attempts + 1):
            dht = hivemind.DHT(
                initial_peers=initial_peers or None,
                host_maddrs=maddrs,
                client_mode=client_mode,
                identity_path=str(identity_path),
                record_validators=[validator],
                start=False,
                authorizer=authorizer,
                **extra,
            )
            if start_node(dht, startup_timeout):  # once ready, its p2p daemon has read the identity file
                break
            log.warning("DHT node not ready within %.0f s (attempt %d of %d)", startup_timeout, attempt, attempts)
        else:
            raise RuntimeError(
                f"the DHT node did not start within {startup_timeout:g} s, {attempts} times in a row "
                f"(initial peers: {', '.join(initial_peers or []) or 'none'})"
            )
    if record_key is RSAPrivateKey.process_wide():
        _process_wide_nodes.add(dht)
    dht.record_owner = validator.local_public_key.decode()  # what this node's subkeys end with
    dht.record_key = record_key  # and what they are signed with (hivemind's progress tracker signs with it too)
    return dht


def start_node(dht: hivemind.DHT, timeout: float) -> bool:
    """Start `dht` (made with `start=False`) and wait until it is ready, at most `timeout` seconds;
    False when it was not: then it is ended, with its p2pd (`make_dht` says why a deadline). Its calls
    send each process's result pipe once (swarm/dht_calls.py)."""
    cheap_calls(dht)
    try:
        dht.run_in_background(await_ready=True, timeout=timeout)
        return True
    except TimeoutError:
        # It reads its pipe only once ready, so it cannot be asked to shut down; its p2pd ends with it.
        dht.kill()
        dht.join(timeout=10)
        return False


def started_dht(timeout: float = 60.0, **options) -> hivemind.DHT:
    """`hivemind.DHT(**options)`, started and ready within `timeout` seconds; RuntimeError (the node
    ended) when it is not. For nodes that are no member's (`make_dht` is theirs): an attacker's in
    the tests, a benchmark's many-owner writer or hivemind reference."""
    dht = hivemind.DHT(start=False, **options)
    if not start_node(dht, timeout):
        raise RuntimeError(f"a DHT node did not start within {timeout:g} s")
    return dht


def node_key() -> RSAPrivateKey:
    """The key a new node of this process signs with (see `make_dht`): the process-wide one, unless
    a live node of this process already holds it."""
    process_wide_taken = any(node.is_alive() for node in _process_wide_nodes)
    return RSAPrivateKey() if process_wide_taken else RSAPrivateKey.process_wide()


def identity_key(path: Path) -> RSAPrivateKey:
    """The RSA key of a DHT identity file (libp2p's format, as hivemind writes it), created when
    missing: a node started with it signs its records with the key its peer id derives from."""
    if not path.exists():
        P2P.generate_identity(str(path))
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": crypto_pb2.PrivateKey.FromString(path.read_bytes()).data})  # as unpickled
    return key


def _write_identity(key: RSAPrivateKey, path: Path) -> Path:
    """Write `key` as a DHT identity file (what `identity_key` reads), readable by this user only."""
    identity = crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=key.to_bytes())  # as P2P.generate_identity
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
        f.write(identity.SerializeToString())
    return path


@functools.lru_cache(maxsize=4096)
def signer_peer_id(public_key: str) -> str | None:
    """The DHT peer id that the RSA `public_key` of an owner marker derives from (libp2p's rule, as in
    hivemind's PeerID.from_identity); None for a key that does not parse. Every stage record read
    asks (about 60 us uncached), so the cache holds a big swarm's peers (a few MB at most)."""
    try:
        public = serialization.load_ssh_public_key(public_key.encode())
    except (ValueError, TypeError):
        return None
    der = public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(multihash.encode(hashlib.sha256(encoded).digest(), "sha2-256")).to_base58()


def maddr_peer_ids(maddrs: list[str]) -> set[str]:
    """The peer ids in multiaddrs (`.../p2p/PEER_ID`), e.g. the coordinator's from /api/v1/join."""
    return {m.rsplit("/p2p/", 1)[1] for m in maddrs if "/p2p/" in m}


def host_maddr(host: str, port: int) -> str:
    """The TCP multiaddr of HOST (an IPv4 address, an IPv6 address or a DNS name) and PORT."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return f"/dns/{host}/tcp/{port}"
    return f"/ip{ip.version}/{host}/tcp/{port}"


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    return [str(m) for m in dht.get_visible_maddrs()]


# RSASignatureValidator's marker of an owned key or subkey, `[owner:PUBLIC KEY]`, as text.
OWNER_MARKER = re.compile(RSASignatureValidator.PUBLIC_KEY_REGEX.decode())


def owned_subkey(dht: hivemind.DHT, name: str) -> str:
    """The subkey of this node's record `name`: only this node can sign a record under it."""
    return name + dht.record_owner


def _store(dht: hivemind.DHT, key: str, name: str, value: dict, ttl: float, timeout: float | None) -> bool:
    """Store this node's record `name` (signed); with `timeout`, give up (False) when the DHT does not
    confirm in time (0: hand it to the DHT and go on, unconfirmed)."""
    now = get_dht_time()
    subkey = owned_subkey(dht, name)
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


def publish_norm_share(dht: hivemind.DHT, run_id: str, share: NormShare, timeout: float | None = None) -> bool:
    return _store(dht, norm_key(run_id, share.step), share.peer_id, share.model_dump(), NORM_TTL_S, timeout)


def publish_digest(dht: hivemind.DHT, run_id: str, digest: WeightsDigest, timeout: float | None = 0) -> bool:
    """By default without waiting for the DHT: a replica publishes one after every step."""
    return _store(dht, digest_key(run_id, digest.stage), digest.peer_id, digest.model_dump(), TTL_S, timeout)


def shutdown_dht(dht: hivemind.DHT) -> None:
    """Stop the DHT process and its p2pd. A signal sent to the whole process group (Ctrl-C in a
    terminal) may have ended them already; then there is nothing to ask, only to reap."""
    if dht.is_alive():
        dht.shutdown()
    else:
        dht.join(timeout=3)


# How often a get that waits looks whether the DHT process is still there.
GET_POLL_S = 0.5


def get(dht: hivemind.DHT, key: str, timeout: float | None = None):
    """The latest value under `key`; with `timeout`, TimeoutError when no answer came in time, or none
    can come (the DHT process ended), and the get is cancelled; without, it waits as long as it takes.
    In hivemind 1.1.12 a get waits with no end for a DHT process that ended under it: SIGTERM to a
    peer's process group ends its DHT process too, and a peer whose loop was in a get then (likely when
    the DHT is slow to answer: a node frozen, a loaded machine) never saw the signal."""
    future = dht.get(key, latest=True, return_future=True)
    if timeout is None:
        return future.result()
    deadline = time.monotonic() + timeout
    while True:
        try:
            return future.result(timeout=min(GET_POLL_S, max(0.0, deadline - time.monotonic())))
        except TimeoutError:
            gone = not dht.is_alive()
            if gone or time.monotonic() >= deadline:
                future.cancel()
                why = "its process ended" if gone else f"none in {timeout:g} s"
                raise TimeoutError(f"no answer from the DHT for {key!r}: {why}") from None


def _read(
    dht: hivemind.DHT,
    key: str,
    model: type[BaseModel],
    id_of: Callable,
    signers: set[str] | None = None,
    self_signed: bool = False,
    timeout: float | None = None,
) -> list:
    """The records under `key` that are owned (their subkey names them and ends in their writer's
    key, which the DHT checked the signature against) and well-formed; with `signers`, only those
    signed with the identity key of one of these DHT peer ids. `id_of(record)` must be the name in
    the subkey: a writer cannot pass its record off as another's. With `self_signed` (the name is a
    DHT peer id), the name must also be the signer's own peer id: nobody else can speak for it.
    With `timeout`, TimeoutError when the DHT has not answered in time (`get`)."""
    found = get(dht, key, timeout)
    if found is None or not isinstance(found.value, dict):
        return []
    records = []
    for subkey, item in found.value.items():
        marker = OWNER_MARKER.search(subkey) if isinstance(subkey, str) else None
        if marker is None:
            log.warning("ignoring an unsigned record under %s", key)
            continue
        name = subkey[: marker.start()]
        signer = signer_peer_id(marker.group(1))
        if signers is not None and signer not in signers:
            continue
        if self_signed and signer != name:
            log.warning("ignoring a record under %s/%s signed by another peer's key (%s)", key, name, signer)
            continue
        try:
            record = model.model_validate(item.value)
        except (ValidationError, AttributeError, TypeError) as err:
            log.warning("ignoring a malformed record under %s/%s: %s", key, name, err)
            continue
        if id_of(record) != name:
            log.warning("ignoring a record under %s/%s that names %r", key, name, id_of(record))
            continue
        records.append(record)
    return records


class ProgressReport(BaseModel):
    """One replica's report to its stage's hivemind progress tracker (its `LocalTrainingProgress`)."""

    model_config = ConfigDict(extra="ignore")

    peer_id: bytes
    epoch: int = Field(ge=0, le=MAX_STEP)
    samples_accumulated: int = Field(ge=0)


def read_progress(dht: hivemind.DHT, run_id: str, stage: int) -> list[tuple[str, int, int]]:
    """(peer id, step, samples) of each report to stage `stage`'s progress tracker that its replica
    signed itself (`signed_progress`)."""
    found = dht.get(f"{averaging_prefix(run_id, stage)}_progress", latest=True)
    return signed_progress(found.value) if found is not None and isinstance(found.value, dict) else []


def signed_progress(entries: dict) -> list[tuple[str, int, int]]:
    """(peer id, step, samples) of each entry of a stage's progress key (subkey -> value with
    expiration, as the DHT returns it) that the replica it names signed. hivemind's tracker stores a
    report under its writer's owner marker alone (a bytes subkey), so `_read` does not apply."""
    reports = []
    for subkey, item in entries.items():
        text = subkey.decode(errors="replace") if isinstance(subkey, bytes) else str(subkey)
        marker = OWNER_MARKER.fullmatch(text)
        try:
            report = ProgressReport.model_validate(item.value)
            peer = PeerID(report.peer_id).to_base58()
        except (ValidationError, AttributeError, TypeError, ValueError):
            continue
        if marker is None or signer_peer_id(marker.group(1)) != peer:
            continue  # unsigned, or signed by another peer: nobody speaks for another replica
        reports.append((peer, report.epoch, report.samples_accumulated))
    return reports


def read_stage(dht: hivemind.DHT, run_id: str, stage: int, timeout: float | None = None) -> list[PeerRecord]:
    """The stage's peer records, each signed by the peer it names (see the module docstring)."""
    key = stage_key(run_id, stage)
    records = _read(dht, key, PeerRecord, lambda r: r.peer_id, self_signed=True, timeout=timeout)
    return [r for r in records if r.stage == stage]


def read_trainers(dht: hivemind.DHT, run_id: str, timeout: float | None = None) -> list[TrainerRecord]:
    """The run's trainer records: owned, but not self-signed (a trainer id is not a DHT peer id)."""
    return _read(dht, trainers_key(run_id), TrainerRecord, lambda r: r.trainer_id, timeout=timeout)


def read_control(dht: hivemind.DHT, run_id: str, coordinators: set[str] | None = None) -> ControlState:
    """The run's control record; when there is none (never stored, or its coordinator has been gone
    for CONTROL_TTL_S) the run is not paused. With `coordinators` (DHT peer ids, see
    `maddr_peer_ids`), only what those coordinators signed counts: the operator's word is theirs."""
    records = _read(dht, control_key(run_id), ControlState, lambda _: CONTROL_SUBKEY, coordinators)
    return max(records, key=lambda c: c.updated, default=ControlState())


def read_removed(
    dht: hivemind.DHT, run_id: str, coordinators: set[str] | None = None, timeout: float | None = None
) -> set[str]:
    """Peer ids the operator removed from the run (with `coordinators`: through one of those)."""
    records = _read(dht, removed_key(run_id), RemovedRecord, lambda r: r.peer_id, coordinators, timeout=timeout)
    return {r.peer_id for r in records}


def stage_members(dht: hivemind.DHT, run_id: str, stage: int) -> set[str]:
    """The peer ids with a record in `stage` now (in any state: a joining peer takes part in steps)."""
    return {p.peer_id for p in read_stage(dht, run_id, stage)}


def read_norm_shares(dht: hivemind.DHT, run_id: str, step: int) -> list[NormShare]:
    """The norm shares published for global `step`, each signed by the peer it names (which stage's
    share counts is `stage_norms`'s to say)."""
    shares = _read(dht, norm_key(run_id, step), NormShare, lambda r: r.peer_id, self_signed=True)
    return [r for r in shares if r.step == step]


def stage_norms(shares: list[NormShare], step: int, members: dict[int, set[str]]) -> dict[int, float]:
    """Each stage's squared norm at `step`: the median of the shares its `members` (peer ids by stage)
    published. A share of anyone else is not the stage's word, and the median keeps one lying member
    from setting it (the replicas of a stage average the same gradient, so honest ones agree)."""
    by_stage: dict[int, list[float]] = {}
    for share in shares:
        if share.step == step and share.peer_id in members.get(share.stage, ()):
            by_stage.setdefault(share.stage, []).append(share.squared)
    return {stage: statistics.median(values) for stage, values in by_stage.items()}


def read_replica_digests(
    dht: hivemind.DHT,
    run_id: str,
    stage: int,
    step: int | None = None,
    members: Callable[[], set[str]] | None = None,
) -> list[WeightsDigest]:
    """The digest each replica of `stage` published last (with the step it was taken after; only those
    after `step` when given): only those signed by a peer with a record in the stage now (`members`:
    those peer ids, when the caller keeps them; read from the DHT otherwise)."""
    digests = _read(dht, digest_key(run_id, stage), WeightsDigest, lambda r: r.peer_id, self_signed=True)
    digests = [d for d in digests if d.stage == stage and (step is None or d.step == step)]
    if not digests:
        return []
    stage_ids = members() if members is not None else stage_members(dht, run_id, stage)
    return [d for d in digests if d.peer_id in stage_ids]


def read_digests(
    dht: hivemind.DHT, run_id: str, stage: int, step: int, members: Callable[[], set[str]] | None = None
) -> dict[str, str]:
    """The digests of the weights the replicas of `stage` hold after `step`, by peer id."""
    return {d.peer_id: d.digest for d in read_replica_digests(dht, run_id, stage, step, members)}


class SwarmView(BaseModel):
    """Everything the DHT says about one run at one moment."""

    stages: list[list[PeerRecord]]
    trainers: list[TrainerRecord]
    read_at: float

    def online(self, stage: int) -> list[PeerRecord]:
        return [p for p in self.stages[stage] if p.state == "online"]

    def stage_throughputs(self) -> list[float]:
        return [sum(p.throughput for p in self.online(k)) for k in range(len(self.stages))]

    def routable(self, stage: int, now: float) -> list[PeerRecord]:
        """The peers a trainer sends `stage`'s calls to at DHT time `now`: those online on it, but for a
        peer that moves with make-before-break (peer/daemon.py `PeerDaemon.move`) once the time it
        announced it would be ready has passed: that one goes to its target, at the throughput it
        measured there. A trainer's view of the DHT lags; without the announced time, a stage that a
        peer moved to would get no calls from it until its new record reached the trainer, and its old
        stage would send it calls it refuses. A peer late on its own word fails a call or two there,
        and is retried elsewhere and banned with back-off like any failing peer."""
        here = [p for p in self.online(stage) if not switched(p, now)]
        known = {p.peer_id for p in here}
        arriving = [
            p.model_copy(update={"stage": stage, "throughput": p.capacity, "moving_to": None, "ready_at": None})
            for k, records in enumerate(self.stages)
            if k != stage
            for p in records
            if p.state == "online" and p.moving_to == stage and switched(p, now) and p.peer_id not in known
        ]
        return here + arriving


def switched(record: PeerRecord, now: float) -> bool:
    """Whether `record`, of a peer moving between stages, announced it would serve its target by `now`."""
    return record.moving_to is not None and record.ready_at is not None and record.ready_at <= now


def read_swarm(dht: hivemind.DHT, run_id: str, num_stages: int, timeout: float | None = None) -> SwarmView:
    """Every stage's records and the trainers'; `timeout` bounds all of these reads together (`get`)."""
    deadline = None if timeout is None else time.monotonic() + timeout

    def left() -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    return SwarmView(
        stages=[read_stage(dht, run_id, k, left()) for k in range(num_stages)],
        trainers=read_trainers(dht, run_id, left()),
        read_at=time.time(),
    )


def reconnect(dht: hivemind.DHT, maddrs: list[str], timeout: float = 10.0) -> int:
    """Ping the DHT nodes at `maddrs` (`.../p2p/PEER_ID`) so that those that answer go (back) into
    this node's routing table; returns how many answered.

    hivemind drops a node that stops answering from the routing table and never asks its initial
    peers again. So a client node (a trainer) whose known nodes have all gone — volunteers leaving,
    the coordinator restarting — is cut off for good: every read comes back empty. hivemind has no
    call for this, hence the node's own ping, which is how it bootstraps."""
    targets: dict[str, list[str]] = {}  # peer id -> its multiaddrs (strings: they cross to the DHT process)
    for m in maddrs:
        with contextlib.suppress(Exception):  # a malformed address is skipped, not fatal
            targets.setdefault(Multiaddr(m)["p2p"], []).append(m)
    return sum(_pinged(dht, targets, timeout))  # none answering: the next round retries


def _pinged(dht: hivemind.DHT, targets: dict[str, list[str]], timeout: float) -> list[bool]:
    """Whether each of `targets` (peer id -> multiaddrs to dial first, if any) answered a ping within
    `timeout`; all False when the DHT process is gone or does not answer in time."""
    if not targets:
        return []
    try:
        answers = dht.run_coroutine(functools.partial(_ping, targets=targets, timeout=timeout), return_future=True)
        return answers.result(timeout=timeout + 1)
    except Exception:
        return [False] * len(targets)


async def _ping(_dht, node, targets: dict[str, list[str]], timeout: float) -> list[bool]:
    """In the DHT process (`DHT.run_coroutine` pickles what it runs, so this lives at module level):
    dial each peer at its multiaddrs, if any, and ping it; whether each answered within `timeout`."""

    async def one(peer_id: str, maddrs: list[str]) -> bool:
        peer = PeerID.from_base58(peer_id)
        if maddrs:
            with contextlib.suppress(Exception):  # unreachable now: the ping below fails as well
                await node.p2p._client.connect(peer, [Multiaddr(m) for m in maddrs])
        return await node.protocol.call_ping(peer, validate=False, strict=False) is not None

    async def bounded(peer_id: str, maddrs: list[str]) -> bool:
        return await asyncio.wait_for(one(peer_id, maddrs), timeout)

    answers = await asyncio.gather(*(bounded(p, m) for p, m in targets.items()), return_exceptions=True)
    return [a is True for a in answers]


def answering(dht: hivemind.DHT, peers: list[bytes], timeout: float = 1.0) -> set[bytes]:
    """Which of these DHT peers (peer ids as bytes) answer a ping within `timeout` seconds. A peer
    whose process died answers none: on loopback its refused connection says so at once, elsewhere
    the timeout does."""
    peers = list(dict.fromkeys(peers))
    found = _pinged(dht, {PeerID(p).to_base58(): [] for p in peers}, timeout)
    return {p for p, ok in zip(peers, found, strict=True) if ok}


class Reconnector:
    """Keeps a node in touch with its run's DHT (see `reconnect`): it remembers the DHT addresses the
    swarm's peers announce, and when a read of the swarm finds a stage with no online peer, pings
    them and the initial peers (the coordinator's), at most every `period` seconds."""

    def __init__(self, dht: hivemind.DHT, initial_peers: list[str], period: float = 5.0, keep: int = 64):
        self.dht, self.initial_peers, self.period, self.keep = dht, list(initial_peers), period, keep
        self.known: dict[str, float] = {}  # multiaddr -> when last announced by an online peer
        self.last = -float("inf")
        self.pings = 0  # rounds of pings sent

    def check(self, view: SwarmView) -> bool:
        """Remember `view`'s addresses; reconnect when a stage looks empty. True when it pinged."""
        now = time.monotonic()
        for k in range(len(view.stages)):
            for p in view.online(k):
                for m in p.dht_addrs:
                    self.known[m] = now
        if len(self.known) > self.keep:  # the most recently seen ones
            self.known = dict(sorted(self.known.items(), key=lambda kv: kv[1])[-self.keep :])
        if all(view.online(k) for k in range(len(view.stages))) or now - self.last < self.period:
            return False
        self.last = now
        self.pings += 1
        reconnect(self.dht, self.initial_peers + [m for m in self.known if m not in self.initial_peers])
        return True
