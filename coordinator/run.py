"""`swarm coordinator`: the run's first DHT node, a background reader of the swarm, and the REST API.

What outlives the process lies in the state directory: the DHT identity (`dht.key`), the peers'
DHT addresses last seen (`peers.json`), the operator's pause (`control.json`), the run CA (`ca.key`,
`ca.pem`), the invites and revoked peers (`invites.json`, see coordinator.invites), the trainers'
leases of the data's shards and the epoch's progress (`leases.json`, see coordinator.leases) and the run's
history of progress points and events (`history.sqlite`, see coordinator.history). A coordinator
started again on the same ports with the same state directory has the same multiaddrs and finds
the running swarm at once; training never needed it.

Shutdown: SIGTERM or SIGINT sets an event the main thread waits on; it then stops uvicorn (which
runs in a thread of its own, so it installs no signal handlers of its own), stops the reader
thread and shuts the DHT down (its child process and the p2pd daemon with it), and returns 0.
"""

from __future__ import annotations

import datetime
import functools
import logging
import signal
import tempfile
import threading
import time
from pathlib import Path

import hivemind
import uvicorn
from hivemind.p2p import P2PDaemonError

from coordinator.app import JoinInfo, create_app
from coordinator.ca import CERT_TTL, RunCA
from coordinator.contributions import Contributions
from coordinator.control import ControlPublisher, OperatorControl
from coordinator.history import History, HistoryRecorder
from coordinator.invites import Invites
from coordinator.known_peers import KnownPeers
from coordinator.leases import DEFAULT_TTL_S, ShardLeases
from coordinator.view import SwarmReader, ViewHolder, empty_view
from swarm.config import ConfigError, RunConfig
from swarm.data import shards
from swarm.identity import Member
from swarm.net import announce_address, cleartext_warning
from swarm.ready import CoordinatorReady, write_ready
from swarm.records import identity_key, make_dht, read_removed, shutdown_dht, visible_maddrs
from swarm.relay import RelayHub, bearer_admission, start_relay

log = logging.getLogger(__name__)

# Each read asks the DHT nodes holding the run's records (the peers') for them: every 2 s halves what
# a coordinator costs its volunteers over every 1 s, and the page polling every second sees it.
READ_EVERY_S = 2.0
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


def start_dht(
    host: str, dht_port: int, state_dir: Path, known: KnownPeers, ca: RunCA, announce_host: str | None = None
) -> tuple[hivemind.DHT, Member]:
    """The coordinator's DHT node, with the identity kept in `state_dir/dht.key` (so, on the same
    port, the same multiaddrs as before a restart), bootstrapped from the peers it saw last, and its
    membership of the run, certified by the run's `ca` (the node answers members only)."""
    identity = state_dir / "dht.key"
    member = ca.member("coordinator", identity_key(identity))
    options = dict(identity_path=identity, announce_host=announce_host, authorizer=member.authorizer())
    initial = known.load()
    dht = None
    if initial:
        try:
            dht = make_dht(initial, host, dht_port, **options)
        except P2PDaemonError as err:  # all of them gone: this is a new swarm, or a new start of it
            log.warning(f"coordinator: none of the {len(initial)} saved peers answers ({err}); starting afresh")
    if dht is None:
        dht = make_dht(None, host, dht_port, **options)
    member.start(dht, functools.partial(read_removed, dht, ca.run_id, {dht.peer_id.to_base58()}))
    return dht, member


def open_state_dir(path: Path) -> Path:
    """Create the coordinator's state folder when missing and check that it takes files; a clear
    error (ConfigError) when it cannot be created or written."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise ConfigError(f"--state-dir {path}: cannot keep the coordinator's state there ({err})") from None
    return path


def shard_leases(run: RunConfig, state_dir: Path, ttl_s: float) -> ShardLeases | None:
    """The leases of the run's shards, kept in `state_dir/leases.json`; None (trainers then each read
    every shard) when the data cannot be listed here, e.g. files that only the trainers' machines hold."""
    try:
        names = [shard.name for shard in shards(run.data)]
    except ConfigError as err:
        log.warning(f"no shard leases: the coordinator cannot list the run's data ({err}); every trainer reads it all")
        return None
    return ShardLeases(names, state_dir / "leases.json", ttl_s, seed=run.training.seed)


def serve_coordinator(
    run: RunConfig,
    host: str,
    port: int,
    dht_port: int,
    state_dir: Path,
    token: str | None = None,
    announce_host: str | None = None,
    join_token: str | None = None,
    ready_file: Path | None = None,
    tls: tuple[Path, Path] | None = None,
    invite_only: bool = False,
    cert_ttl: datetime.timedelta = CERT_TTL,
    lease_ttl_s: float = DEFAULT_TTL_S,
    relay_port: int = 0,
    relay_capacity: int = 32,
) -> int:
    """`announce_host`: the address peers on other machines reach this one at, handed out in
    /api/v1/join instead of the listening interfaces' addresses. `join_token`: a token peers and
    trainers may send to join (the shared invite). `invite_only`: joining needs a token even without
    a `join_token` (an invite's); with neither, anyone may join. `ready_file`: where to say, once HTTP
    serves, at which URL and DHT addresses (swarm/ready.py). `tls`: (certificate, key) files to serve
    HTTPS with (uvicorn's); None: plain HTTP. `cert_ttl`: how long member certificates are valid
    (members renew them halfway). `lease_ttl_s`: a trainer's lease of a shard not renewed for this
    long expires, and the shard goes to the next trainer that asks. `relay_port`, `relay_capacity`:
    the relay for peers nobody can dial (swarm/relay.py), on that port (0: any free one), carrying at
    most that many peers (0: no relay)."""
    # Signals first arrive here; until the server is up, a signal just ends the start-up early.
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()

    open_state_dir(state_dir)
    invites = Invites(state_dir / "invites.json", shared_token=join_token, invite_only=invite_only)
    history = History(state_dir / "history.sqlite")
    leases = shard_leases(run, state_dir, lease_ttl_s)
    recorder = HistoryRecorder(history)
    contributions = Contributions(state_dir / "history.sqlite")
    known = KnownPeers(state_dir / "peers.json")
    # The DHT's process is forked before our handlers are installed, so it keeps the default
    # SIGTERM action (a signal to the whole process group ends it directly).
    ca = RunCA.load_or_create(state_dir, run.run_id, cert_ttl)
    dht, member = start_dht(host, dht_port, state_dir, known, ca, announce_host)
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    control = OperatorControl(token, invites, state_dir / "control.json", on_event=recorder.control)
    publisher = ControlPublisher(dht, run.run_id, control)
    reader: SwarmReader | None = None
    server: uvicorn.Server | None = None
    server_thread: threading.Thread | None = None
    relay_server, relay = None, None
    code = 0
    try:
        if relay_capacity > 0:
            admit = bearer_admission(invites.admit) if invites.guarded else None
            hub = RelayHub(host, announce_host, relay_capacity, admit)
            relay_server, bound_relay = start_relay(hub, relay_port)
            relay = announce_address(host, bound_relay, announce_host)
        maddrs = visible_maddrs(dht)
        holder = ViewHolder(empty_view(run.stages.count))
        holder.listen(recorder)  # events and progress points into the history
        holder.listen(contributions)  # each peer's samples and speed over time
        reader = SwarmReader(dht, run.run_id, run.stages.count, holder, interval=READ_EVERY_S)
        reader.start()
        publisher.start()

        app = create_app(
            run,
            holder,
            JoinInfo(initial_peers=maddrs, relay=relay),
            control,
            history,
            ca=ca,
            leases=leases,
            contributions=contributions,
        )
        cert, key = tls if tls else (None, None)
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", ssl_certfile=cert, ssl_keyfile=key)
        server = uvicorn.Server(config)
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
            log.error(f"the coordinator could not serve HTTP on {host}:{port}")
            code = 1
            return code

        bound = _bound_port(server, port)
        url = f"{'https' if tls else 'http'}://{host}:{bound}"
        for secret, given in (("the join token", join_token or invite_only), ("the operator token", token)):
            if given and (warning := cleartext_warning(url, secret)):
                log.warning(warning)
        log.info(f"coordinator of run {run.run_id!r} at {url} (DHT {maddrs[0] if maddrs else '?'})")
        if run.data.local_paths():
            log.warning(
                f"data names local files ({', '.join(run.data.local_paths())}): trainers refuse to read them "
                "unless started with --allow-config-files, or give their own --data PATH"
            )
        if ready_file is not None:
            write_ready(ready_file, CoordinatorReady(run_id=run.run_id, url=url, http_port=bound, dht_maddrs=maddrs))
        next_status = time.monotonic() + STATUS_EVERY_S
        while not stop.wait(min(1.0, max(0.0, next_status - time.monotonic()))):
            if not server_thread.is_alive():
                log.error("the HTTP server stopped unexpectedly")
                code = 1
                break
            known.update(holder.get())
            if time.monotonic() >= next_status:
                log.info(_status(run, holder))
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
        if relay_server is not None:
            relay_server.stop(grace=1.0)
        history.close()
        contributions.close()
        publisher.stop(timeout=2.0)
        member.stop()
        shutdown_dht(dht)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        log.info(f"coordinator of run {run.run_id!r}: stopped")
