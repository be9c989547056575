"""The trainer's clients of the peers it calls (each with its own gRPC channel), kept while in use.

Policy: a client not used for `idle_s` seconds is closed and forgotten, and made anew when its peer
is called again. Kept for good, every peer that ever served the trainer (and every address a peer
came back at) held an open channel for the rest of the run: with churn, without bound. `idle_s`
longer than any call lasts means that no client is closed under a call in flight (one that started
with it has reached its deadline by then), and that the peers being called keep theirs.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
C = TypeVar("C")


class IdleClients(Generic[K, C]):
    """Clients by key, least recently used first; not thread-safe (the caller holds its lock)."""

    def __init__(
        self,
        make: Callable[[K], C],
        close: Callable[[C], None],
        idle_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`make`: a new client for a key; `close`: ends a client that is dropped."""
        self.make, self.close, self.idle_s, self.clock = make, close, idle_s, clock
        self._clients: OrderedDict[K, tuple[C, float]] = OrderedDict()  # key -> (client, last used)

    def get(self, key: K) -> C:
        """The client for `key`, made if there is none; idle ones are closed first."""
        now = self.clock()
        self.drop_idle(now)
        client = self._clients.pop(key, (None, 0.0))[0]
        if client is None:
            client = self.make(key)
        self._clients[key] = (client, now)  # the most recently used last
        return client

    def drop_idle(self, now: float) -> None:
        """Close the clients not used since `now - idle_s`."""
        while self._clients:
            key, (client, used) = next(iter(self._clients.items()))
            if now - used < self.idle_s:
                return
            del self._clients[key]
            self.close(client)

    def clear(self) -> None:
        """Close every client."""
        while self._clients:
            self.close(self._clients.popitem(last=False)[1][0])

    def values(self) -> list[C]:
        return [client for client, _ in self._clients.values()]

    def __len__(self) -> int:
        return len(self._clients)
