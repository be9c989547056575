"""`swarm peer --coordinator URL`: a volunteer's daemon.

Join: fetch the run config and DHT addresses from the coordinator, join the DHT, pick a stage (the
one with the lowest total throughput, after a short random wait so that peers joining together
spread out), announce `joining`, measure this device's throughput (cached), take the stage's
current weights from a live peer of that stage (else the seeded init), start the stage worker,
announce `online` and keep refreshing the record.

Leave (SIGTERM / SIGINT): announce `leaving`, let in-flight requests finish while new ones are
refused, stop the DHT node and its p2pd, exit 0.
"""

from __future__ import annotations

import logging
import random
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import grpc
import torch

from peer.service import start_server
from peer.throughput import cached_throughput
from peer.worker import StageWorker
from swarm.client import StageClient
from swarm.config import ConfigError, RunConfig
from swarm.device import resolve_device
from swarm.join import fetch_join
from swarm.placement import pick_stage
from swarm.records import REFRESH_S, PeerRecord, announce_peer, make_dht, read_stage, read_swarm, shutdown_dht
from swarm.wire import decode

log = logging.getLogger("swarm.peer")


def download_weights(run: RunConfig, stage: int, records: list[PeerRecord], me: str) -> tuple[dict | None, str]:
    """The stage's current weights from the first live peer that answers; (None, '') when none does."""
    for record in sorted(records, key=lambda r: -r.optimizer_steps):
        if record.peer_id == me or record.state != "online":
            continue
        client = StageClient(record.address, run, timeout=60)
        try:
            state = client.parameters(stage)
            return {p.name: decode(p.tensor) for p in state.parameters}, record.public_name or record.address
        except grpc.RpcError as err:
            log.warning("could not fetch stage %d weights from %s: %s", stage, record.address, err.code().name)
        finally:
            client.close()
    return None, ""


def announce_address(host: str, port: int) -> str:
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostbyname(socket.gethostname())
    return f"{host}:{port}"


def run_peer(
    coordinator: str,
    stage: int | None,
    host: str,
    port: int,
    device: str | None = None,
    public_name: str = "",
    threads: int | None = None,
    join_wait_s: float = 2.0,
    delay_per_sample: float = 0.0,
    step_log: Path | None = None,
) -> int:
    run, initial_peers = fetch_join(coordinator)
    if stage is not None and not 0 <= stage < run.stages.count:
        raise ConfigError(f"--stage: {stage} is not a stage of run {run.run_id!r} (0..{run.stages.count - 1})")
    if threads:
        torch.set_num_threads(threads)
    dev = resolve_device(device)
    dht = make_dht(initial_peers, host=host if host not in ("", "::") else "0.0.0.0")
    peer_id = dht.peer_id.to_base58()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = worker = None
    try:
        if stage is None:
            time.sleep(random.uniform(0, join_wait_s))  # peers that start together spread out
            view = read_swarm(dht, run.run_id, run.stages.count)
            stage = pick_stage(view.stage_throughputs(), [len(view.stages[k]) for k in range(run.stages.count)])
        record = PeerRecord(
            peer_id=peer_id,
            stage=stage,
            address="",
            public_name=public_name or peer_id[-8:],
            device=str(dev),
            state="joining",
            started=time.time(),
        )
        announce_peer(dht, run.run_id, record)
        print(f"peer {record.public_name}: joining stage {stage} of run {run.run_id!r}", flush=True)
        throughput = cached_throughput(run, stage, dev)
        worker = StageWorker(run, stage, dev, delay_per_sample=delay_per_sample, step_log=step_log)
        weights, source = download_weights(run, stage, read_stage(dht, run.run_id, stage), peer_id)
        if weights is not None:
            worker.load_parameters(weights)
        server, service, bound = start_server(worker, host, port)
        record = record.model_copy(
            update={
                "address": announce_address(host, bound),
                "device": worker.device_name,
                "throughput": throughput,
                "state": "online",
            }
        )
        announce_peer(dht, run.run_id, record)
        print(
            f"peer {record.public_name}: online, stage {stage}, serving on {record.address} "
            f"({worker.device_name}, {throughput:.1f} samples/s measured, weights from "
            f"{source or 'the seeded init'})",
            flush=True,
        )
        last_status = time.monotonic()
        while not stop.wait(REFRESH_S):
            live = worker.throughput
            record = record.model_copy(
                update={
                    "throughput": live if live > 0 else throughput,
                    "queue": len(worker.queue),
                    "samples_served": worker.samples_served,
                    "optimizer_steps": worker.optimizer_steps,
                }
            )
            announce_peer(dht, run.run_id, record, timeout=REFRESH_S)
            if time.monotonic() - last_status > 30:
                last_status = time.monotonic()
                print(
                    f"peer {record.public_name}: stage {stage}, {worker.samples_served} samples served, "
                    f"{worker.optimizer_steps} steps, {record.throughput:.1f} samples/s, queue {record.queue}",
                    file=sys.stderr,
                    flush=True,
                )
        print(f"peer {record.public_name}: leaving", flush=True)
        announce_peer(dht, run.run_id, record.model_copy(update={"state": "leaving"}), ttl=REFRESH_S, timeout=2)
        return 0
    finally:
        if server is not None:
            server.stop(grace=3).wait(5)
        if worker is not None:
            worker.close()
        shutdown_dht(dht)
        if worker is not None:
            print(f"peer stopped after {worker.samples_served} samples and {worker.optimizer_steps} steps", flush=True)
