"""The shards a trainer reads, leased from the run's coordinator: N trainers on one run read disjoint
shards (coordinator/leases.py keeps the leases; swarm.data.TrainStream reads what this hands it).

Each lease is renewed in the background every third of its time to live, with the offset last
reported; a progress report is also sent at once, so that the windows a trainer has trained are on
the coordinator before the trainer moves on: a trainer killed after that hands its shard over from
there, and no window is trained twice. A coordinator out of reach delays the reports (the renewals
try again); a lease that expired meanwhile is gone to another trainer, which this one says.

A trainer asks for a new shard when it has read the last one to its end. While it still holds a
shard not done (its windows are in the stream's shuffle buffer), a refusal ("every shard of the
epoch is leased") lets it train those first; holding none, it waits for one: the epoch ends when
the other trainers finish theirs.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import httpx

from swarm.client import bearer
from swarm.config import ConfigError
from swarm.data import Shard
from swarm.join import answer

log = logging.getLogger(__name__)

TIMEOUT_S = 10.0
UNREACHABLE_WARN_S = 10.0  # say so once the coordinator has been out of reach this long
REACH_S = 30.0  # how long a starting trainer asks a coordinator out of reach (restarting) for the shards


class LeaseLost(RuntimeError):
    """The coordinator knows the lease no more: it expired, and its shard went to another trainer."""


@dataclass
class _Held:
    lease_id: str
    shard: Shard
    epoch: int
    offset: int
    renew_at: float  # time.monotonic() of the next renewal


class CoordinatorShards:
    """A `ShardSource` (swarm.data) over the shard leases of the coordinator at `url`.

    `shards`: this trainer's own list of the run's shards (swarm.data.shards): a lease naming
    another shard at an index means the two read different data, and is refused. `trainer`: this
    trainer's id, shown with its leases. `join_token`: the run's, when it has one."""

    def __init__(self, url: str, shards: list[Shard], trainer: str, join_token: str | None = None):
        self.url, self.shards, self.trainer = url.rstrip("/"), list(shards), trainer
        headers = {"Authorization": bearer(join_token)} if join_token else {}
        self.join_token = join_token
        self.http = httpx.Client(headers=headers, timeout=TIMEOUT_S)
        self._held: dict[tuple[int, int], _Held] = {}  # by (shard index, epoch): one shard may be held twice
        self._lock = threading.Lock()  # the held leases
        self._send = threading.Lock()  # one report at a time: offsets reach the coordinator in order
        self._stop = threading.Event()
        self._refused_until = 0.0  # after "every shard is leased", ask again from then
        self._unreachable_since: float | None = None
        self._renewer = threading.Thread(target=self._renew_loop, name="shard-leases", daemon=True)
        self._renewer.start()

    @classmethod
    def offered(cls, url: str, join_token: str | None = None, reach_s: float = REACH_S) -> bool:
        """Whether the coordinator at `url` leases shards (one that cannot list the run's data does not).
        The trainer has just fetched the run's config from it: one out of reach now is restarting,
        and is asked again for up to `reach_s`."""
        headers = {"Authorization": bearer(join_token)} if join_token else {}
        deadline = time.monotonic() + reach_s
        while True:
            try:
                response = httpx.get(url.rstrip("/") + "/api/v1/data", headers=headers, timeout=TIMEOUT_S)
                break
            except httpx.HTTPError as err:
                if time.monotonic() >= deadline:
                    raise ConfigError(f"--coordinator: cannot reach {url} for the data's shards: {err}") from None
                log.warning(f"coordinator {url} out of reach ({err}); asking again for its data's shards")
                time.sleep(1.0)
        if response.status_code == 404:
            return False
        answer(url, response, join_token)
        return True

    # -- ShardSource ----------------------------------------------------------------------------

    def next_shard(self) -> tuple[Shard, int, int] | None:
        """A leased shard, its start offset and epoch. None when every free shard is leased and this
        trainer still holds one not done; holding none, it waits until one is free."""
        while not self._stop.is_set():
            with self._lock:
                holding = bool(self._held)
            if holding and time.monotonic() < self._refused_until:
                return None
            try:
                body = self._post("/api/v1/data/lease", {"trainer": self.trainer})
            except httpx.HTTPError as err:
                self._unreachable(err)
                if holding:
                    return None
                self._stop.wait(1.0)
                continue
            lease = body["lease"]
            if lease is None:
                self._refused_until = time.monotonic() + float(body["retry_s"])
                if holding:
                    return None
                self._stop.wait(float(body["retry_s"]))
                continue
            return self._take(lease)
        return None

    def progress(self, shard: Shard, epoch: int, offset: int) -> None:
        with self._lock:
            held = self._held.get((shard.index, epoch))
            if held is None:
                return
            held.offset = max(held.offset, offset)
        self._report(held)

    def done(self, shard: Shard, epoch: int) -> None:
        with self._lock:
            held = self._held.pop((shard.index, epoch), None)
        while held is not None and not self._stop.is_set():
            try:
                self._renew(held, done=True)
                return
            except LeaseLost as err:
                log.warning(str(err))
                return
            except httpx.HTTPError as err:
                self._unreachable(err)
                self._stop.wait(1.0)

    # -- the rest -------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop renewing and hand the shards still held back to the coordinator, at their offsets."""
        self._stop.set()
        self._renewer.join(timeout=TIMEOUT_S)
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for h in held:
            try:
                self._renew(h, release=True)
            except (LeaseLost, httpx.HTTPError) as err:
                log.warning(
                    f"shard {h.shard.index} not handed back ({err}): it goes to another trainer when its lease expires"
                )
        self.http.close()

    def _take(self, lease: dict) -> tuple[Shard, int, int]:
        index, name = int(lease["shard"]), str(lease["name"])
        if not 0 <= index < len(self.shards) or self.shards[index].name != name:
            mine = self.shards[index].name if 0 <= index < len(self.shards) else f"none ({len(self.shards)} shards)"
            raise ConfigError(
                f"--coordinator: {self.url} leased shard {index} named {name!r}, but this trainer's shard {index} is "
                f"{mine}: the coordinator and this trainer see different data"
            )
        renew_at = time.monotonic() + float(lease["expires_in_s"]) / 3
        held = _Held(lease["lease_id"], self.shards[index], int(lease["epoch"]), int(lease["offset"]), renew_at)
        with self._lock:
            self._held[index, held.epoch] = held
        log.info(f"leased shard {index} ({name}) of epoch {lease['epoch']} from window {held.offset}")
        return held.shard, held.offset, held.epoch

    def _post(self, path: str, body: dict) -> dict:
        response = self.http.post(self.url + path, json=body)
        if response.status_code == 404 and path != "/api/v1/data/lease":
            raise LeaseLost(response.json().get("detail", response.text))
        if response.status_code in (502, 503, 504):  # a proxy in front of a coordinator that restarts
            raise httpx.HTTPStatusError(f"answered {response.status_code}", request=response.request, response=response)
        body = answer(self.url, response, self.join_token)
        self._unreachable_since = None
        return body

    def _renew(self, held: _Held, done: bool = False, release: bool = False) -> None:
        with self._send:
            body = {"offset": held.offset, "done": done, "release": release}
            answered = self._post(f"/api/v1/data/lease/{held.lease_id}", body)
        held.renew_at = time.monotonic() + float(answered["expires_in_s"]) / 3

    def _report(self, held: _Held) -> None:
        """Send `held`'s offset now; a lost lease is dropped, and said so."""
        try:
            self._renew(held)
        except LeaseLost as err:
            with self._lock:
                if self._held.get((held.shard.index, held.epoch)) is held:
                    del self._held[held.shard.index, held.epoch]
            log.warning(
                f"lost the lease of shard {held.shard.index} (the coordinator did not hear from this trainer within "
                f"its time to live; another trainer reads it from window {held.offset} on): {err}"
            )
        except httpx.HTTPError as err:
            self._unreachable(err)
            held.renew_at = time.monotonic() + 1.0
        except ConfigError as err:  # refused (a token no longer valid): said, and tried again
            log.warning(f"renewing the lease of shard {held.shard.index}: {err}")
            held.renew_at = time.monotonic() + 1.0

    def _unreachable(self, err: Exception) -> None:
        now = time.monotonic()
        if self._unreachable_since is None:
            self._unreachable_since = now
        elif now - self._unreachable_since >= UNREACHABLE_WARN_S:
            log.warning(f"{self.url} out of reach for {now - self._unreachable_since:.0f} s ({err}); trying again")
            self._unreachable_since = now

    def _renew_loop(self) -> None:
        while not self._stop.wait(0.2):
            with self._lock:
                due = [h for h in self._held.values() if time.monotonic() >= h.renew_at]
            for h in due:
                self._report(h)
