"""The DHT addresses of the peers the coordinator saw last, kept in `state_dir/peers.json`.

A coordinator that died and comes back bootstraps its DHT node from them (with its own identity
from `state_dir/dht.key`, see swarm.records.make_dht), so it finds the running swarm at once
instead of waiting for peers to reach it.

Bounded: one live address is enough to bootstrap from, and a record lists as many addresses as its
peer writes there, so the file keeps those of the KEEP_PEERS peers online longest (as their records
say: the likeliest to still be there), at most ADDRS_PER_PEER each.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from swarm.records import SwarmView

log = logging.getLogger(__name__)

KEEP_PEERS = 16
ADDRS_PER_PEER = 4


def bootstrap_addresses(view: SwarmView, peers: int = KEEP_PEERS, per_peer: int = ADDRS_PER_PEER) -> list[str]:
    """The DHT addresses worth keeping from `view`, sorted: the first `per_peer` of each of the
    `peers` online peers that started first (ties by peer id)."""
    online = {p.peer_id: p for k in range(len(view.stages)) for p in view.online(k)}
    chosen = sorted(online.values(), key=lambda p: (p.started, p.peer_id))[:peers]
    return sorted({a for p in chosen for a in p.dht_addrs[:per_peer]})


class KnownPeers:
    def __init__(self, path: Path):
        self.path = path
        self._saved: list[str] = self.load()

    def load(self) -> list[str]:
        """The addresses saved last; none when there is no file or it does not parse."""
        if not self.path.exists():
            return []
        try:
            addrs = json.loads(self.path.read_text())["dht_addrs"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.warning("ignoring %s: %s", self.path, err)
            return []
        addrs = [a for a in addrs if isinstance(a, str)] if isinstance(addrs, list) else []
        return addrs[: KEEP_PEERS * ADDRS_PER_PEER]

    def update(self, view: SwarmView) -> None:
        """Save the online peers' addresses worth keeping (`bootstrap_addresses`) when one appears that
        is not saved yet. A view with only some of the saved peers changes nothing: one read just after
        a restart may miss a few, and a single live address is enough to bootstrap from."""
        addrs = bootstrap_addresses(view)
        if set(addrs) <= set(self._saved):
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"dht_addrs": addrs}, indent=1))
        os.replace(tmp, self.path)
        self._saved = addrs
