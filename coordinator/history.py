"""The run's history as the coordinator saw it: progress points and events, kept in SQLite.

`History` is the store (`state_dir/history.sqlite`, stdlib sqlite3 in WAL mode, one connection
shared by the reader thread and the HTTP handlers under a lock), so a restarted coordinator keeps
the loss curve and the event log, and event ids go on where they stopped. `HistoryRecorder`
listens to the coordinator's ViewHolder (coordinator.view): for each new view it stores the events
derived from the change (coordinator.events) and, at most every POINT_EVERY_S and only when
something moved, a point: global step, loss, tokens/s and each stage's throughput.

The recorder remembers the peers it saw online (so that one back after a move or a restart of the
coordinator has not joined anew) with when it last saw each: a peer not seen online for
SEEN_FORGET_S is forgotten, here and in the file, and joins anew should it come back. Otherwise
every peer id that ever joined (each start of a peer is a new one) stayed for good.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel, Field

from coordinator.events import Event, diff_events, peer_name
from swarm.config import ConfigError
from swarm.records import PeerRecord, SwarmView

POINT_EVERY_S = 2.0  # at most one point this often
MAX_POINTS = 5000  # a longer history is answered thinned out (every k-th point, and the newest)
SEEN_FORGET_S = 3600.0  # a peer not seen online for this long is forgotten
SEEN_REFRESH_S = 60.0  # how often the stored times of the online peers are brought up to date

SCHEMA = """
CREATE TABLE IF NOT EXISTS points (
    t REAL NOT NULL, step INTEGER NOT NULL, loss REAL, val_loss REAL,
    tokens_per_s REAL NOT NULL, stage_throughput TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS points_t ON points (t);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, t REAL NOT NULL, kind TEXT NOT NULL,
    peer TEXT, stage INTEGER, text TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_peer ON events (peer, id);
CREATE TABLE IF NOT EXISTS seen_peers (peer_id TEXT PRIMARY KEY, t REAL NOT NULL);
"""


class HistoryPoint(BaseModel):
    t: float = Field(description="unix time the view was read")
    step: int = Field(description="the global step (see /api/v1/state)")
    loss: float | None
    val_loss: float | None
    tokens_per_s: float
    stage_throughput: list[float] = Field(description="samples/s of each stage's online peers")


def point_of(view: SwarmView) -> HistoryPoint:
    """The run's progress in one view: the trainer with the most steps speaks for the run (its loss),
    all trainers' tokens/s add up; with no trainer the step is the furthest online peer's."""
    lead = max(view.trainers, key=lambda r: (r.steps, r.updated), default=None)
    if lead is not None:
        step = lead.steps
    else:
        step = max((p.optimizer_steps for k in range(len(view.stages)) for p in view.online(k)), default=0)
    return HistoryPoint(
        t=view.read_at,
        step=step,
        loss=lead.loss if lead else None,
        val_loss=lead.val_loss if lead else None,
        tokens_per_s=sum(r.tokens_per_s for r in view.trainers),
        stage_throughput=view.stage_throughputs(),
    )


POINT_COLUMNS = "t, step, loss, val_loss, tokens_per_s, stage_throughput"
EVENT_COLUMNS = "id, t, kind, peer, stage, text"


def _point(row: tuple) -> HistoryPoint:
    t, step, loss, val_loss, tokens_per_s, stage_throughput = row
    return HistoryPoint(
        t=t,
        step=step,
        loss=loss,
        val_loss=val_loss,
        tokens_per_s=tokens_per_s,
        stage_throughput=json.loads(stage_throughput),
    )


class History:
    """Points and events in one SQLite file; safe to share between threads."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(path, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(SCHEMA)
        except sqlite3.Error as err:
            raise ConfigError(f"cannot keep the history in {path}: {err} (move the file away)") from None

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def add_point(self, point: HistoryPoint) -> None:
        with self._lock, self._db:
            self._db.execute(
                "INSERT INTO points VALUES (?, ?, ?, ?, ?, ?)",
                (
                    point.t,
                    point.step,
                    point.loss,
                    point.val_loss,
                    point.tokens_per_s,
                    json.dumps(point.stage_throughput),
                ),
            )

    def add_events(self, events: Iterable[Event]) -> list[Event]:
        """Store events in order; returns them with their ids."""
        stored = []
        with self._lock, self._db:
            for e in events:
                cursor = self._db.execute(
                    "INSERT INTO events (t, kind, peer, stage, text) VALUES (?, ?, ?, ?, ?)",
                    (e.t, e.kind, e.peer, e.stage, e.text),
                )
                stored.append(e.model_copy(update={"id": cursor.lastrowid}))
        return stored

    def points(self, since: float | None = None, max_points: int = MAX_POINTS) -> list[HistoryPoint]:
        """Points at or after `since`, oldest first; more than `max_points` are thinned out evenly
        (the newest is always kept)."""
        since = float("-inf") if since is None else since
        with self._lock:
            (count,) = self._db.execute("SELECT COUNT(*) FROM points WHERE t >= ?", (since,)).fetchone()
            stride = -(-count // max_points) if count > max_points else 1
            rows = self._db.execute(
                f"SELECT {POINT_COLUMNS} FROM "
                "(SELECT *, ROW_NUMBER() OVER (ORDER BY t DESC) - 1 AS age FROM points WHERE t >= ?) "
                "WHERE age % ? = 0 ORDER BY t",
                (since, stride),
            ).fetchall()
        return [_point(row) for row in rows]

    def last_point(self) -> HistoryPoint | None:
        with self._lock:
            row = self._db.execute(f"SELECT {POINT_COLUMNS} FROM points ORDER BY t DESC LIMIT 1").fetchone()
        return _point(row) if row else None

    def events(self, after: int | None = None, limit: int = 200) -> list[Event]:
        """Events with id > `after`, ascending, at most `limit`; without `after`, the newest `limit`."""
        columns = f"SELECT {EVENT_COLUMNS} FROM events"
        with self._lock:
            if after is None:
                rows = self._db.execute(f"{columns} ORDER BY id DESC LIMIT ?", (limit,)).fetchall()[::-1]
            else:
                rows = self._db.execute(f"{columns} WHERE id > ? ORDER BY id LIMIT ?", (after, limit)).fetchall()
        return _events(rows)

    def events_of(self, peer: str, kinds: Iterable[str], limit: int = 500) -> list[Event]:
        """The newest `limit` events of `kinds` naming the peer `peer` (its public name), ascending."""
        kinds = list(kinds)
        marks = ", ".join("?" * len(kinds))
        with self._lock:
            rows = self._db.execute(
                f"SELECT {EVENT_COLUMNS} FROM events WHERE peer = ? AND kind IN ({marks}) ORDER BY id DESC LIMIT ?",
                (peer, *kinds, limit),
            ).fetchall()[::-1]
        return _events(rows)

    def seen_peers(self) -> dict[str, float]:
        """The peers seen online, with when they were last."""
        with self._lock:
            return dict(self._db.execute("SELECT peer_id, t FROM seen_peers"))

    def add_seen_peers(self, peer_ids: Iterable[str], t: float) -> None:
        """`peer_ids` were online at `t`."""
        with self._lock, self._db:
            self._db.executemany(
                "INSERT INTO seen_peers VALUES (?, ?) ON CONFLICT (peer_id) DO UPDATE SET t = MAX(t, excluded.t)",
                [(p, t) for p in peer_ids],
            )

    def forget_seen_peers(self, before: float) -> None:
        """Forget the peers last seen online before `before`."""
        with self._lock, self._db:
            self._db.execute("DELETE FROM seen_peers WHERE t < ?", (before,))


def _events(rows: list[tuple]) -> list[Event]:
    keys = ("id", "t", "kind", "peer", "stage", "text")
    return [Event(**dict(zip(keys, row, strict=True))) for row in rows]


def _moved(a: HistoryPoint, b: HistoryPoint) -> bool:
    return a.model_dump(exclude={"t"}) != b.model_dump(exclude={"t"})


class HistoryRecorder:
    """Turns each new view into stored events and points: a ViewHolder listener (runs on the
    coordinator's reader thread), and the hearer of the operator's actions (control events)."""

    def __init__(self, history: History, every_s: float = POINT_EVERY_S, forget_s: float = SEEN_FORGET_S):
        self.history, self.every_s, self.forget_s = history, every_s, forget_s
        self.last = history.last_point()
        self.seen = history.seen_peers()  # peer id -> when last seen online
        self.refreshed = -float("inf")  # when the stored times were last brought up to date

    def __call__(self, old: SwarmView, new: SwarmView) -> None:
        self.history.add_events(diff_events(old, new, self.seen.keys()))
        t = new.read_at
        online = {p.peer_id for k in range(len(new.stages)) for p in new.online(k)}
        fresh = online - self.seen.keys()
        self.seen.update(dict.fromkeys(online, t))
        if t - self.refreshed >= SEEN_REFRESH_S:
            self.refreshed = t
            self.history.add_seen_peers(online, t)
            self.seen = {p: seen for p, seen in self.seen.items() if seen >= t - self.forget_s}
            self.history.forget_seen_peers(t - self.forget_s)
        elif fresh:
            self.history.add_seen_peers(fresh, t)
        point = point_of(new)
        if self.last is None or (point.t - self.last.t >= self.every_s and _moved(point, self.last)):
            self.history.add_point(point)
            self.last = point

    def control(self, text: str, peer: PeerRecord | None) -> None:
        """An operator's action (coordinator.control's ControlHook)."""
        event = Event(
            t=time.time(),
            kind="control",
            peer=peer_name(peer) if peer else None,
            stage=peer.stage if peer else None,
            text=text,
        )
        self.history.add_events([event])
