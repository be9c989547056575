"""`swarm coordinator`: the run's first DHT node, a background reader of the swarm, and the REST API.

Shutdown: SIGTERM or SIGINT sets an event the main thread waits on; it then stops uvicorn (which
runs in a thread of its own, so it installs no signal handlers of its own), stops the reader
thread and shuts the DHT down (its child process and the p2pd daemon with it), and returns 0.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time

import uvicorn

from coordinator.app import JoinInfo, create_app
from coordinator.view import SwarmReader, ViewHolder, empty_view
from swarm.config import RunConfig
from swarm.records import make_dht, shutdown_dht, visible_maddrs

log = logging.getLogger("coordinator")

READ_EVERY_S = 1.0
STATUS_EVERY_S = 30.0
STARTUP_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 5.0


def _status(run: RunConfig, holder: ViewHolder) -> str:
    view = holder.get()
    online = [len(view.online(k)) for k in range(len(view.stages))]
    throughputs = view.stage_throughputs()
    stages = ", ".join(f"{n} online {t:.1f}/s" for n, t in zip(online, throughputs, strict=True))
    return (
        f"coordinator of run {run.run_id!r}: stages [{stages}], {len(view.trainers)} trainers, "
        f"view {time.time() - view.read_at:.1f} s old ({holder.reads} reads, {holder.failures} failed)"
    )


def _bound_port(server: uvicorn.Server, default: int) -> int:
    for s in getattr(server, "servers", []) or []:
        for sock in s.sockets:
            return sock.getsockname()[1]
    return default


def serve_coordinator(run: RunConfig, host: str, port: int, dht_port: int) -> int:
    # Signals first arrive here; until the server is up, a signal just ends the start-up early.
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()

    # The DHT's process is forked before our handlers are installed, so it keeps the default
    # SIGTERM action (a signal to the whole process group ends it directly).
    dht = make_dht(None, host, dht_port)
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    reader: SwarmReader | None = None
    server: uvicorn.Server | None = None
    server_thread: threading.Thread | None = None
    code = 0
    try:
        maddrs = visible_maddrs(dht)
        holder = ViewHolder(empty_view(run.stages.count))
        reader = SwarmReader(dht, run.run_id, run.stages.count, holder, interval=READ_EVERY_S)
        reader.start()

        app = create_app(run, holder, JoinInfo(initial_peers=maddrs))
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        # Off the main thread uvicorn leaves signal handling to us (no capture and re-raise).
        server_thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
        server_thread.start()

        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not server.started and server_thread.is_alive() and not stop.is_set():
            if time.monotonic() > deadline:
                break
            stop.wait(0.05)
        if stop.is_set():
            return 0
        if not server.started:
            print(f"error: the coordinator could not serve HTTP on {host}:{port}", file=sys.stderr, flush=True)
            code = 1
            return code

        bound = _bound_port(server, port)
        print(
            f"coordinator of run {run.run_id!r} at http://{host}:{bound} (DHT {maddrs[0] if maddrs else '?'})",
            flush=True,
        )
        next_status = time.monotonic() + STATUS_EVERY_S
        while not stop.wait(min(1.0, max(0.0, next_status - time.monotonic()))):
            if not server_thread.is_alive():
                print("error: the HTTP server stopped unexpectedly", file=sys.stderr, flush=True)
                code = 1
                break
            if time.monotonic() >= next_status:
                print(_status(run, holder), file=sys.stderr, flush=True)
                next_status = time.monotonic() + STATUS_EVERY_S
        return code
    finally:
        if server is not None and server_thread is not None:
            server.should_exit = True
            server_thread.join(STOP_TIMEOUT_S)
            if server_thread.is_alive():
                server.force_exit = True
                server_thread.join(1.0)
        if reader is not None:
            reader.stop(timeout=2.0)
        shutdown_dht(dht)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        print(f"coordinator of run {run.run_id!r}: stopped", flush=True)
