"""The operator's control of a run: pause and resume training, remove a peer.

The coordinator is the only writer. Its decisions live in an `OperatorControl` (the pause also in
`state_dir/control.json`, so a restarted coordinator pauses the run again), and a `ControlPublisher`
thread stores them in the DHT (swarm.records): the pause every CONTROL_REFRESH_S with a time to
live of CONTROL_TTL_S, so the pause of a coordinator that died lapses by itself and the run is
never stuck without one to resume it; a removal once, retried until the DHT takes it. HTTP
handlers only change this object, so they never wait on the DHT.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

import hivemind

from swarm.records import CONTROL_REFRESH_S, ControlState, PeerRecord, announce_control, announce_removed

log = logging.getLogger(__name__)

# Told of every operator action: its text, and the peer it was about (None for pause and resume).
ControlHook = Callable[[str, PeerRecord | None], None]


class OperatorControl:
    """What the operator decided: paused or not, and which peers to remove from the run.

    `token` is the operator's Bearer token; without one, control is disabled (coordinator.api_control
    answers 403). `path` keeps the pause across restarts; `on_event` hears of every action."""

    def __init__(self, token: str | None, path: Path | None = None, on_event: ControlHook | None = None):
        self.token = token or None
        self.path, self.on_event = path, on_event
        self._lock = threading.Lock()
        self._paused = self._load()
        self._pending: dict[str, PeerRecord] = {}  # removals the DHT has not taken yet
        self.changed = threading.Event()  # wakes the publisher at once

    def _load(self) -> bool:
        if self.path is None or not self.path.exists():
            return False
        try:
            return bool(json.loads(self.path.read_text())["paused"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.warning("ignoring %s (%s): the run starts unpaused", self.path, err)
            return False

    @property
    def paused(self) -> bool:
        with self._lock:
            return self._paused

    def set_paused(self, paused: bool) -> None:
        with self._lock:
            changed, self._paused = self._paused != paused, paused
            if self.path is not None:
                tmp = self.path.with_suffix(".tmp")
                tmp.write_text(json.dumps({"paused": paused}))
                os.replace(tmp, self.path)
        if changed:
            self.changed.set()
            self._tell("training paused by the operator" if paused else "training resumed by the operator", None)

    def remove(self, peer: PeerRecord) -> None:
        with self._lock:
            self._pending[peer.peer_id] = peer
        self.changed.set()
        self._tell(f"peer {peer.public_name} removed from the run by the operator", peer)

    def pending_removals(self) -> list[PeerRecord]:
        with self._lock:
            return list(self._pending.values())

    def removal_stored(self, peer_id: str) -> None:
        with self._lock:
            self._pending.pop(peer_id, None)

    def _tell(self, text: str, peer: PeerRecord | None) -> None:
        log.info(text)
        if self.on_event is not None:
            self.on_event(text, peer)


class ControlPublisher(threading.Thread):
    """Stores the operator's decisions in the DHT: at once when they change, and the pause again
    every `interval` seconds, until stopped."""

    def __init__(self, dht: hivemind.DHT, run_id: str, control: OperatorControl, interval: float = CONTROL_REFRESH_S):
        # A daemon thread, like the view's reader: a DHT call that never returns cannot block exit.
        super().__init__(name="control-publisher", daemon=True)
        self.dht, self.run_id, self.control, self.interval = dht, run_id, control, interval
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.control.changed.clear()
            announce_control(self.dht, self.run_id, ControlState(paused=self.control.paused), timeout=self.interval)
            for peer in self.control.pending_removals():
                if announce_removed(self.dht, self.run_id, peer.peer_id, timeout=self.interval):
                    self.control.removal_stored(peer.peer_id)
                else:
                    log.warning("the DHT did not take the removal of %s yet; trying again", peer.peer_id)
            self.control.changed.wait(self.interval)

    def stop(self, timeout: float = 3.0) -> None:
        self._stop_event.set()
        self.control.changed.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)
