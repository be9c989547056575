"""A crowd of peer records in a real coordinator's DHT: how the coordinator and dashboard benchmarks (and
the dashboard's tests) get a swarm of a thousand peers without a thousand processes.

A second DHT node in this process, bootstrapped from the coordinator's /api/v1/join, stores `count`
peer records (spread evenly over the stages; one in ten 'joining', one in fifty 'leaving', the rest
'online') and one trainer record, all with a time to live longer than any benchmark. Readers take a
stage record only from the peer it names (`swarm.records.read_stage`), so each peer record's id
derives from a key of its own, made beforehand, that signs it. `crowded_coordinator` starts a
coordinator of its own, stores the crowd into it and waits until its state lists every record.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import hivemind
import httpx
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from swarm.children import start_coordinator, stop_all
from swarm.join import join_run
from swarm.records import (
    PeerRecord,
    TrainerRecord,
    shutdown_dht,
    signer_peer_id,
    stage_key,
    started_dht,
    trainers_key,
)

TTL_S = 900.0  # longer than a whole benchmark: no record expires while it is timed
# Records a store_many call takes: about 12 kB pickled. Python's multiprocessing writes a message over
# 16 KiB in two parts, and hivemind's DHT process reads its end of the pipe without blocking: it read the
# first part of 50 records' call alone, failed (BlockingIOError) and lost the pipe.
STORE_BATCH = 25


def signing_keys(count: int) -> list[RSAPrivateKey]:
    """A key per peer record: 1,024-bit RSA, six times faster to make than hivemind's 2,048 bits (a
    thousand of those take a minute and more here) and all that the DHT's signature check needs."""
    keys = []
    for _ in range(count):
        key = RSAPrivateKey.__new__(RSAPrivateKey)
        key._private_key = rsa.generate_private_key(public_exponent=65537, key_size=1024)  # as RSAPrivateKey()
        keys.append(key)
    return keys


def public_key(key: RSAPrivateKey) -> str:
    return key.get_public_key().to_bytes().decode()


class ManyOwners(RSASignatureValidator):
    """Signs each record with the key its subkey's owner marker names: one node stores the records of
    many peers, each signed as if that peer had stored it."""

    def __init__(self, keys: list[RSAPrivateKey]):
        super().__init__(keys[0])
        self.keys = {public_key(k).encode(): k for k in keys}

    def sign_value(self, record):
        owner = self._PUBLIC_KEY_RE.search(record.subkey or b"")
        key = self.keys.get(owner.group(1)) if owner else None
        if key is None:
            return record.value
        return record.value + self.SIGNATURE_FORMAT.replace(b"_value_", key.sign(self._serialize_record(record)))


def owned(key: RSAPrivateKey, name: str) -> str:
    """The subkey of record `name` owned by `key` (as swarm.records.announce_* name a node's own)."""
    return f"{name}[owner:{public_key(key)}]"


def store_as(dht: hivemind.DHT, key: RSAPrivateKey, dht_key: str, name: str, value: dict) -> bool:
    """Store `value` as the owner of `key`'s record `name`, with TTL_S to live."""
    now = get_dht_time()
    future = dht.store(
        dht_key, dict(value, updated=now), expiration_time=now + TTL_S, subkey=owned(key, name), return_future=True
    )
    return bool(future.result(timeout=30))


async def _store_many(_dht, node, keys: list, values: list, expiration: float, subkeys: list) -> int:
    return sum(bool(ok) for ok in (await node.store_many(keys, values, expiration, subkeys=subkeys)).values())


def store_records(dht: hivemind.DHT, run_id: str, records: list[PeerRecord], keys: list[RSAPrivateKey]) -> int:
    """Store each of `records` as the owner of its key; how many the DHT accepted. In batches of
    STORE_BATCH, one after another, through hivemind's DHTNode.store_many: one search of the DHT per
    stage key and one store call per node for a whole batch, where DHT.store searches and calls once
    per record (a thousand records took 20-25 s so, on 2 loaded cores)."""
    stored = 0
    for first in range(0, len(records), STORE_BATCH):
        batch = list(zip(records[first : first + STORE_BATCH], keys[first : first + STORE_BATCH], strict=True))
        now = get_dht_time()
        store = functools.partial(
            _store_many,
            keys=[stage_key(run_id, r.stage) for r, _ in batch],
            values=[dict(r.model_dump(), updated=now) for r, _ in batch],
            expiration=now + TTL_S,
            subkeys=[owned(k, r.peer_id) for r, k in batch],
        )
        stored += dht.run_coroutine(store, return_future=True).result(timeout=60)
    return stored


def peer_records(keys: list[RSAPrivateKey], stages: int) -> list[PeerRecord]:
    records = []
    for i, key in enumerate(keys):
        state = "leaving" if i % 50 == 49 else "joining" if i % 10 == 9 else "online"
        records.append(
            PeerRecord(
                peer_id=signer_peer_id(public_key(key)),
                stage=i % stages,
                address=f"10.0.{i // 250}.{i % 250}:{30000 + i}",
                public_name=f"volunteer-{i:05d}",
                device="cuda:0 (NVIDIA GeForce RTX 3090)",
                throughput=10.0 + i % 17,
                queue=i % 5,
                state=state,
                started=time.time(),
                samples_served=1000 * i,
                optimizer_steps=1234,
                weights_from="live peers",
            )
        )
    return records


def add_crowd_arguments(p: argparse.ArgumentParser) -> None:
    """The options of a benchmark that stores a crowd into a coordinator of its own."""
    p.add_argument("--config", default="configs/tiny.toml", help="run config (its stage count is replaced)")
    p.add_argument("--stages", type=int, default=4, help="pipeline stages (the config's model must have enough layers)")
    p.add_argument("--peers", type=int, default=1000, help="peer records to store")
    p.add_argument("--timeout-s", type=float, default=180.0, help="for the state to list every peer")
    p.add_argument("--log-dir", default=None)


def with_stages(config: Path | str, stages: int, folder: Path) -> Path:
    """`config` copied into `folder` with `stages` pipeline stages (its model must have enough layers)."""
    out = folder / "run.toml"
    text, found = re.subn(r"(\[stages\]\s*count\s*=\s*)\d+", rf"\g<1>{stages}", Path(config).read_text())
    if not found:
        raise SystemExit(f"{config}: no [stages] count to replace")
    out.write_text(text)
    return out


@dataclass
class Crowd:
    """The records stored, and the DHT node that stored them (it must live while they are read)."""

    dht: hivemind.DHT
    records: list[PeerRecord]
    trainer: TrainerRecord
    stored: int  # peer records the DHT accepted
    began: float  # time.monotonic() of the first store

    def wait_listed(self, url: str, timeout_s: float) -> float:
        """Seconds from the first store until the coordinator's /api/v1/state lists every record (it
        re-reads the DHT every coordinator.run.READ_EVERY_S)."""
        with httpx.Client(timeout=30) as client:
            while True:
                state = client.get(f"{url}/api/v1/state").json()
                listed = sum(len(s["peers"]) for s in state["stages"])
                if listed >= len(self.records):
                    return time.monotonic() - self.began
                if time.monotonic() - self.began > timeout_s:
                    raise RuntimeError(f"/api/v1/state lists {listed} of {len(self.records)} peers after {timeout_s} s")
                time.sleep(0.5)

    def close(self) -> None:
        shutdown_dht(self.dht)


def store_crowd(url: str, count: int, stages: int) -> Crowd:
    """Store `count` peer records and one trainer record into the run of the coordinator at `url`."""
    join = httpx.get(f"{url}/api/v1/join", timeout=10).json()
    made = time.monotonic()
    keys = signing_keys(count + 1)  # the last one the trainer's
    print(f"made {len(keys)} signing keys in {time.monotonic() - made:.1f} s", flush=True)
    run_id = join["run_id"]
    member = join_run(url, RSAPrivateKey(), "trainer", run_id)  # the run's DHT answers members only
    dht = started_dht(
        initial_peers=join["initial_peers"],
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        client_mode=True,
        record_validators=[ManyOwners(keys)],
        authorizer=member.authorizer(),
    )
    try:
        records = peer_records(keys[:-1], stages)
        began = time.monotonic()
        stored = store_records(dht, run_id, records, keys[:-1])
        trainer = TrainerRecord(trainer_id="bench-trainer", steps=1234, loss=2.5, tokens_per_s=9000.0, wire_bytes=10**9)
        store_as(dht, keys[-1], trainers_key(run_id), trainer.trainer_id, trainer.model_dump())
    except BaseException:
        shutdown_dht(dht)
        raise
    print(f"stored {stored} of {len(records)} peer records in {time.monotonic() - began:.1f} s", flush=True)
    return Crowd(dht, records, trainer, stored, began)


@contextlib.contextmanager
def crowded_coordinator(
    config: Path | str, stages: int, peers: int, folder: Path, timeout_s: float
) -> Iterator[tuple[str, Crowd, float]]:
    """A real coordinator (`swarm coordinator`, its log in `folder`) of `config` with `stages` stages,
    `peers` records stored into its DHT: its URL, the crowd, and the seconds until its state listed
    them all. Everything is stopped on the way out."""
    coordinator, url = start_coordinator(with_stages(config, stages, folder), folder / "coordinator.log")
    crowd = None
    try:
        crowd = store_crowd(url, peers, stages)
        listed_s = crowd.wait_listed(url, timeout_s)
        yield url, crowd, listed_s
    finally:
        if crowd is not None:
            crowd.close()
        stop_all([coordinator])
