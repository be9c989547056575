"""`swarm peer --config C --stage K --port P`: serve one stage by hand until SIGTERM or Ctrl-C."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

import torch

from peer.options import NO_FAULTS, Faults
from peer.service import start_server
from peer.worker import StageWorker
from swarm.config import ConfigError, RunConfig
from swarm.device import resolve_device
from swarm.memory import budget, check_stage, peer_inflight
from swarm.ready import PeerReady, write_ready

log = logging.getLogger(__name__)


def serve_stage(
    run: RunConfig,
    stage: int,
    host: str,
    port: int,
    device: str | None = None,
    threads: int | None = None,
    status_every: float = 30.0,
    join_token: str | None = None,
    ready_file: Path | None = None,
    inflight: int | None = None,
    max_memory: int | None = None,
    faults: Faults = NO_FAULTS,
) -> int:
    """`join_token`: every call must carry it (peer/auth.py); None: anyone may call. `ready_file`:
    where to say, once the server serves, at which address (swarm/ready.py). `inflight`: forward
    graphs kept for their backward (default `serve.cache_size`); the stage is refused (StageTooLarge)
    when it needs more memory than the device has, or than `max_memory` bytes. `faults`: what a test
    makes the worker do wrong (peer/options.py)."""
    if not 0 <= stage < run.stages.count:
        raise ConfigError(f"--stage: {stage} is not a stage of run {run.run_id!r} (0..{run.stages.count - 1})")
    if threads:
        torch.set_num_threads(threads)
    dev = resolve_device(device)
    need = check_stage(run, stage, dev.type, peer_inflight(run, inflight), budget(dev, max_memory))
    log.info(need.describe())
    worker = StageWorker(run, stage, dev, faults=faults, cache_size=inflight)
    server, service, bound = start_server(worker, host, port, join_token=join_token)
    layers = run.stage_layers(stage)
    log.info(
        f"stage {stage}/{run.stages.count} of run {run.run_id!r} (layers {layers.start}..{layers.stop - 1}) "
        f"serving on {host}:{bound} ({worker.device_name}, codec {run.wire.codec})"
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # Only now: whoever waits for the file may stop the stage at once, and cleanly.
    if ready_file is not None:
        write_ready(ready_file, PeerReady(run_id=run.run_id, stage=stage, address=f"{host}:{bound}"))
    while not stop.wait(status_every):
        log.info(
            f"stage {stage}: {worker.samples_served} samples served, {worker.optimizer_steps} steps, "
            f"{worker.throughput:.1f} samples/s, queue {len(worker.queue)}, "
            f"wire {service.bytes_received:,} B in / {service.bytes_sent:,} B out"
        )
    server.stop(grace=5)
    worker.close()
    peak = f", peak GPU memory {torch.cuda.max_memory_allocated(dev) / 2**20:.0f} MiB" if dev.type == "cuda" else ""
    print(
        f"stage {stage}: stopped after {worker.samples_served} samples and {worker.optimizer_steps} steps{peak} "
        f"({worker.time_use()})",
        flush=True,
    )
    return 0
