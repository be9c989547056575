"""`python -m benchmarks coordinator`: how fast the coordinator answers /api/v1/state and /metrics for a big swarm.

A real coordinator (`swarm coordinator`) of the config with `--stages` stages. A second DHT node
in this process, bootstrapped from the coordinator's /api/v1/join, stores `--peers` peer records
(spread evenly over the stages; one in ten 'joining', one in fifty 'leaving', the rest 'online') and
one trainer record, all with a time to live longer than the benchmark. Readers take a stage record
only from the peer it names (`swarm.records.read_stage`), so each peer record's id derives from a key
of its own, made beforehand, that signs it. Once /api/v1/state lists every peer, `--requests`
sequential GETs of /api/v1/state, then as many of /metrics, go through one keep-alive HTTP client;
each is timed from the request to the last byte of the body.

Reported: p50 and p99 latency of each endpoint (ms), the state's size, and the seconds from the
first store until the state listed every peer (the coordinator re-reads the DHT every second).
Goal: p99 <= --goal-ms for both endpoints.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import hivemind
import httpx
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from benchmarks.common import log_dir, start_coordinator, stop_all
from benchmarks.results import append_row
from swarm.join import join_run
from swarm.records import PeerRecord, TrainerRecord, shutdown_dht, signer_peer_id, stage_key, trainers_key

SECTION = "coordinator: /api/v1/state and /metrics latency with many peers in the DHT"
TTL_S = 900.0  # longer than the whole benchmark: no record expires while it is timed


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="configs/tiny.toml", help="run config (its stage count is replaced)")
    p.add_argument("--stages", type=int, default=4, help="pipeline stages (the config's model must have enough layers)")
    p.add_argument("--peers", type=int, default=1000, help="peer records to store")
    p.add_argument("--requests", type=int, default=200, help="GETs of each endpoint")
    p.add_argument("--goal-ms", type=float, default=200.0)
    p.add_argument("--timeout-s", type=float, default=180.0, help="for the state to list every peer")
    p.add_argument("--log-dir", default=None)


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


def store_as(dht: hivemind.DHT, key: RSAPrivateKey, dht_key: str, name: str, value: dict) -> bool:
    """Store `value` as the owner of `key`'s record `name` (as swarm.records.announce_* do for a node's
    own key), with TTL_S to live."""
    now = get_dht_time()
    subkey = f"{name}[owner:{public_key(key)}]"
    future = dht.store(
        dht_key, dict(value, updated=now), expiration_time=now + TTL_S, subkey=subkey, return_future=True
    )
    return bool(future.result(timeout=30))


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


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def timed_gets(client: httpx.Client, url: str, n: int) -> tuple[list[float], int]:
    """Milliseconds of each of `n` GETs, and the size of the last body."""
    times, size = [], 0
    for _ in range(n):
        start = time.perf_counter()
        response = client.get(url)
        size = len(response.content)
        times.append((time.perf_counter() - start) * 1000)
        response.raise_for_status()
    return times, size


def run(args: argparse.Namespace) -> str:
    tmp = log_dir(args.log_dir, "coordinator")
    config = tmp / "run.toml"
    text, found = re.subn(r"(\[stages\]\s*count\s*=\s*)\d+", rf"\g<1>{args.stages}", Path(args.config).read_text())
    if not found:
        raise SystemExit(f"{args.config}: no [stages] count to replace")
    config.write_text(text)
    coordinator, url = start_coordinator(config, tmp / "coordinator.log")
    dht = None
    try:
        join = httpx.get(f"{url}/api/v1/join", timeout=10).json()
        made = time.monotonic()
        keys = signing_keys(args.peers + 1)  # the last one the trainer's
        print(f"made {len(keys)} signing keys in {time.monotonic() - made:.1f} s", flush=True)
        run_id = join["run_id"]
        member = join_run(url, RSAPrivateKey(), "trainer", run_id)  # the run's DHT answers members only
        dht = hivemind.DHT(
            initial_peers=join["initial_peers"],
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            client_mode=True,
            record_validators=[ManyOwners(keys)],
            authorizer=member.authorizer(),
            start=True,
        )
        records = peer_records(keys[:-1], args.stages)
        began = time.monotonic()
        with ThreadPoolExecutor(max_workers=16) as pool:
            stored = list(
                pool.map(
                    lambda r, k: store_as(dht, k, stage_key(run_id, r.stage), r.peer_id, r.model_dump()), records, keys
                )
            )
        trainer = TrainerRecord(trainer_id="bench-trainer", steps=1234, loss=2.5, tokens_per_s=9000.0, wire_bytes=10**9)
        store_as(dht, keys[-1], trainers_key(run_id), trainer.trainer_id, trainer.model_dump())
        print(f"stored {sum(stored)} of {len(records)} peer records in {time.monotonic() - began:.1f} s", flush=True)

        with httpx.Client(timeout=30) as client:
            listed = 0
            while listed < args.peers:
                if time.monotonic() - began > args.timeout_s:
                    raise RuntimeError(f"/api/v1/state lists {listed} of {args.peers} peers after {args.timeout_s} s")
                time.sleep(0.5)
                state = client.get(f"{url}/api/v1/state").json()
                listed = sum(len(s["peers"]) for s in state["stages"])
            visible_s = time.monotonic() - began
            print(f"/api/v1/state lists all {listed} peers after {visible_s:.1f} s", flush=True)
            load = os.getloadavg()[0]
            state_ms, state_bytes = timed_gets(client, f"{url}/api/v1/state", args.requests)
            metrics_ms, _ = timed_gets(client, f"{url}/metrics", args.requests)
    finally:
        if dht is not None:
            shutdown_dht(dht)
        stop_all([coordinator])

    p50s, p99s = percentile(state_ms, 50), percentile(state_ms, 99)
    p50m, p99m = percentile(metrics_ms, 50), percentile(metrics_ms, 99)
    met = "met" if max(p99s, p99m) <= args.goal_ms else "not met"
    print(f"/api/v1/state p50 {p50s:.1f} p99 {p99s:.1f} ms; /metrics p50 {p50m:.1f} p99 {p99m:.1f} ms", flush=True)
    return append_row(
        SECTION,
        [
            "config",
            "stages",
            "peers",
            "requests",
            "state p50 ms",
            "state p99 ms",
            "state size",
            "metrics p50 ms",
            "metrics p99 ms",
            "listed after s",
            "notes",
        ],
        [
            args.config,
            args.stages,
            args.peers,
            args.requests,
            f"{p50s:.1f}",
            f"{p99s:.1f}",
            f"{state_bytes / 1024:.0f} KiB",
            f"{p50m:.1f}",
            f"{p99m:.1f}",
            f"{visible_s:.1f}",
            f"goal p99 <= {args.goal_ms:g} ms: {met}; sequential GETs over one keep-alive connection from the "
            f"same machine, the coordinator re-reading the DHT every second meanwhile; load avg {load:.1f} at start",
        ],
    )
