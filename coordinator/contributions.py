"""What each volunteer contributed, as the coordinator read it from the DHT: samples served across
stage moves and restarts, and its speed over time.

A peer's record counts the samples it served since it last went online (`samples_served` starts
again at 0 after each move), so `Contributions`, a listener of the coordinator's ViewHolder, keeps per
peer id the count of its earlier stints (`served_before`) and the current one (`served_now`): a count
lower than the last one read starts a new stint. What a peer served after the coordinator's last read
of its record and before it moved is not counted (at most one refresh, `swarm.records.REFRESH_S`).
A volunteer is its public name: every start of `swarm peer` is a new peer id, and all ids under one
name add up.

Speed points (stage, state, announced samples/s, samples of the stint) are kept per peer at most every
`POINT_EVERY_S`, and for a large swarm less often, `POINTS_PER_S` rows a second for all peers together
(a thousand peers: one point each every 200 s), and for `KEEP_S`.

The tables live in the coordinator's history file (coordinator.history) through a connection of
their own, so neither store waits on the other's lock.
"""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, Field

from coordinator.events import peer_name
from swarm.config import ConfigError
from swarm.records import PeerRecord, SwarmView

POINT_EVERY_S = 2.0  # a peer's speed point at most this often
POINTS_PER_S = 5.0  # ... and all peers' points together at most this many a second
KEEP_S = 7 * 86400.0  # speed points older than this are deleted
PRUNE_EVERY_S = 600.0
MAX_SPEED_POINTS = 1000  # a longer speed history is answered thinned out (every k-th point, the newest kept)

SCHEMA = """
CREATE TABLE IF NOT EXISTS peer_totals (
    peer_id TEXT PRIMARY KEY, name TEXT NOT NULL, first_seen REAL NOT NULL, last_seen REAL NOT NULL,
    served_before INTEGER NOT NULL, served_now INTEGER NOT NULL, stage INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS peer_totals_name ON peer_totals (name);
CREATE TABLE IF NOT EXISTS peer_points (
    t REAL NOT NULL, peer_id TEXT NOT NULL, stage INTEGER NOT NULL, state TEXT NOT NULL,
    throughput REAL NOT NULL, samples INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS peer_points_peer ON peer_points (peer_id, t);
"""


class SpeedPoint(BaseModel):
    t: float = Field(description="unix time the record was read")
    peer_id: str
    stage: int
    state: str
    throughput: float = Field(description="the samples/s its record announced")
    samples: int = Field(description="samples served since it last went online (its record's count)")


@dataclass
class Tally:
    """One peer id's samples as read so far."""

    peer_id: str
    name: str
    first_seen: float
    last_seen: float
    served_before: int  # samples of its earlier stints
    served_now: int  # samples of the current one, as last read
    stage: int

    @property
    def served(self) -> int:
        return self.served_before + self.served_now


def tally(known: Tally | None, records: list[PeerRecord], t: float) -> Tally:
    """`known` brought up to the peer's `records` of a view read at `t` (two while it moves between stages)."""
    current = max(records, key=lambda p: (p.state == "online", p.updated))
    samples = max(p.samples_served for p in records)
    if known is None:
        return Tally(current.peer_id, peer_name(current), t, t, 0, samples, current.stage)
    before = known.served_before + (known.served_now if samples < known.served_now else 0)
    return Tally(known.peer_id, peer_name(current), known.first_seen, t, before, samples, current.stage)


class Contributions:
    """Every peer's tally and speed points in SQLite; a ViewHolder listener (runs on the reader thread)
    that the API reads from its own threads."""

    def __init__(self, path: Path):
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(path, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(SCHEMA)
            rows = self._db.execute("SELECT * FROM peer_totals").fetchall()
        except sqlite3.Error as err:
            raise ConfigError(f"cannot keep the peers' contributions in {path}: {err} (move the file away)") from None
        self.tallies = {row[0]: Tally(*row) for row in rows}
        self.pointed: dict[str, float] = {}  # peer id -> when its last speed point was stored
        self.pruned = -float("inf")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __call__(self, old: SwarmView, new: SwarmView) -> None:
        t = new.read_at
        by_peer: dict[str, list[PeerRecord]] = {}
        for records in new.stages:
            for p in records:
                by_peer.setdefault(p.peer_id, []).append(p)
        changed = []
        for pid, records in by_peer.items():
            known = self.tallies.get(pid)
            now = tally(known, records, t)
            # last_seen alone is written with the next change: one write per peer per second is too many.
            if known is None or (now.served_now, now.served_before, now.stage, now.name) != (
                known.served_now,
                known.served_before,
                known.stage,
                known.name,
            ):
                changed.append(now)
            self.tallies[pid] = now
        every = max(POINT_EVERY_S, len(by_peer) / POINTS_PER_S)
        points = []
        for pid, records in by_peer.items():
            if t - self.pointed.get(pid, -float("inf")) >= every:
                self.pointed[pid] = t
                p = max(records, key=lambda r: (r.state == "online", r.updated))
                points.append((t, pid, p.stage, p.state, p.throughput, p.samples_served))
        with self._lock, self._db:
            self._db.executemany(
                "INSERT INTO peer_totals VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (peer_id) DO UPDATE SET "
                "name = excluded.name, last_seen = excluded.last_seen, served_before = excluded.served_before, "
                "served_now = excluded.served_now, stage = excluded.stage",
                [
                    (c.peer_id, c.name, c.first_seen, c.last_seen, c.served_before, c.served_now, c.stage)
                    for c in changed
                ],
            )
            self._db.executemany("INSERT INTO peer_points VALUES (?, ?, ?, ?, ?, ?)", points)
            if t - self.pruned >= PRUNE_EVERY_S:
                self.pruned = t
                self._db.execute("DELETE FROM peer_points WHERE t < ?", (t - KEEP_S,))

    def peer_ids(self, peer: str) -> list[str]:
        """The ids of the volunteer `peer` names: a peer id itself, else every id under that public name."""
        with self._lock:
            if self._db.execute("SELECT 1 FROM peer_totals WHERE peer_id = ?", (peer,)).fetchone():
                return [peer]
            rows = self._db.execute("SELECT peer_id FROM peer_totals WHERE name = ? ORDER BY first_seen", (peer,))
            return [pid for (pid,) in rows]

    def tallies_of(self, peer_ids: list[str]) -> list[Tally]:
        """As read last (newer than what is stored: last_seen is written with changes only)."""
        return [self.tallies[pid] for pid in peer_ids if pid in self.tallies]

    def swarm_served(self) -> int:
        """Samples served by every peer ever seen, all stints."""
        return sum(t.served for t in list(self.tallies.values()))

    def speed(self, peer_ids: list[str], max_points: int = MAX_SPEED_POINTS) -> list[SpeedPoint]:
        """The speed points of `peer_ids`, oldest first, thinned evenly to `max_points` (the newest kept)."""
        marks = ", ".join("?" * len(peer_ids))
        with self._lock:
            rows = self._db.execute(
                f"SELECT * FROM peer_points WHERE peer_id IN ({marks}) ORDER BY t DESC", peer_ids
            ).fetchall()
        stride = -(-len(rows) // max_points) if len(rows) > max_points else 1
        keys = ("t", "peer_id", "stage", "state", "throughput", "samples")
        return [SpeedPoint(**dict(zip(keys, row, strict=True))) for row in rows[::stride][::-1]]
