"""The operator's control of a run: pause and resume training, remove a peer, mint and revoke invites.

The coordinator is the only writer. Its decisions live in an `OperatorControl` (the pause also in
`state_dir/control.json`, so a restarted coordinator pauses the run again; invites and revoked
peers in coordinator.invites), and a `ControlPublisher` thread stores them in the DHT
(swarm.records): the pause every CONTROL_REFRESH_S with a time to live of CONTROL_TTL_S, so the
pause of a coordinator that died lapses by itself and the run is never stuck without one to resume
it; each revoked peer (removed by the operator, or certified under a revoked invite) as a `removed`
record at once, then again every REVOKED_REFRESH_S, for as long as the coordinator runs (and from
its first seconds after a restart). HTTP handlers only change this object, so they never wait on
the DHT.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path

import hivemind

from coordinator.invites import InviteInfo, Invites, write_private
from swarm.records import (
    CONTROL_REFRESH_S,
    REMOVED_TTL_S,
    ControlState,
    PeerRecord,
    announce_control,
    announce_removed,
)

log = logging.getLogger(__name__)

# A removed record lives REMOVED_TTL_S (600 s); stored again this often it never lapses while the
# coordinator runs, and comes back within a minute when the nodes that held it leave the DHT.
REVOKED_REFRESH_S = min(60.0, REMOVED_TTL_S / 4)

# Told of every operator action: its text, and the peer it was about (None for pause and resume).
ControlHook = Callable[[str, PeerRecord | None], None]


class OperatorControl:
    """What the operator decided: paused or not, who is invited, and which peers are revoked.

    `token` is the operator's Bearer token; without one, control is disabled (coordinator.api_control
    answers 403). `invites` keeps the invites and the revoked peers; `path` keeps the pause across
    restarts; `on_event` hears of every action."""

    def __init__(
        self,
        token: str | None,
        invites: Invites | None = None,
        path: Path | None = None,
        on_event: ControlHook | None = None,
    ):
        self.token = token or None
        self.invites = invites if invites is not None else Invites(None)
        self.path, self.on_event = path, on_event
        self._lock = threading.Lock()
        self._paused = self._load()
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
                write_private(self.path, json.dumps({"paused": paused}))
        if changed:
            self.changed.set()
            self._tell("training paused by the operator" if paused else "training resumed by the operator", None)

    def remove(self, peer: PeerRecord) -> None:
        """Revoke the peer: told to leave, refused by members and refused a new certificate."""
        self.invites.remove_peer(peer.peer_id)
        self.changed.set()
        self._tell(f"peer {peer.public_name} removed from the run by the operator", peer)

    def mint_invite(self, name: str, max_peers: int | None, expires_s: float | None) -> tuple[str, InviteInfo]:
        """A new invite: its token and its listing (see Invites.mint)."""
        minted = self.invites.mint(name, max_peers, expires_s)
        limit = f"at most {max_peers} peers" if max_peers is not None else "no peer limit"
        self._tell(f"invite {name} minted by the operator ({limit})", None)
        return minted

    def revoke_invite(self, name: str) -> InviteInfo:
        """Revoke invite `name` and every peer certified under it (see Invites.revoke)."""
        info = self.invites.revoke(name)
        self.changed.set()
        self._tell(f"invite {name} revoked by the operator ({info.identities} peer identities with it)", None)
        return info

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
        stored: dict[str, float] = {}  # revoked peer id -> time.monotonic() the DHT last took it
        while not self._stop_event.is_set():
            self.control.changed.clear()
            announce_control(self.dht, self.run_id, ControlState(paused=self.control.paused), timeout=self.interval)
            for peer_id in sorted(self.control.invites.revoked_peers()):
                if time.monotonic() - stored.get(peer_id, -math.inf) < REVOKED_REFRESH_S:
                    continue
                if announce_removed(self.dht, self.run_id, peer_id, timeout=self.interval):
                    stored[peer_id] = time.monotonic()
                else:
                    log.warning("the DHT did not take the revocation of %s yet; trying again", peer_id)
            self.control.changed.wait(self.interval)

    def stop(self, timeout: float = 3.0) -> None:
        self._stop_event.set()
        self.control.changed.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)
