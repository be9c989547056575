"""How others reach a peer: whether the coordinator can dial it back, and, when nobody can, the relay
it serves through; with `--relay`, the relay it runs for the peers nobody can dial.

A volunteer behind a home router dials out and nobody dials in: the coordinator dials a new peer back
(coordinator/api_reachability.py) and, when that fails, the peer keeps a stream open to a relay (a
reachable peer started with `--relay`, else the coordinator's) and announces the address the relay
gives it (swarm/relay.py).
"""

from __future__ import annotations

import logging
import random
import re
import socket
from typing import Protocol

from peer.options import PeerOptions
from swarm.config import ConfigError, RunConfig
from swarm.identity import Member
from swarm.join import dial_back
from swarm.net import announce_address
from swarm.records import PeerRecord, read_swarm
from swarm.relay import RelayHub, RelayLink, start_relay

log = logging.getLogger(__name__)


def any_relay(dht, run: RunConfig) -> bool:
    """Whether a peer of the run relays (`--relay`)."""
    return any(p.relay for s in read_swarm(dht, run.run_id, run.stages.count).stages for p in s)


def reach_before_serving(options: PeerOptions, host: str) -> dict | None:
    """The coordinator's dial-back answer (coordinator/api_reachability.py) on this machine, asked before
    anything serves: on two listening sockets standing in for the stage service and the DHT node (on
    their ports when fixed). A peer it finds unreachable starts its DHT node in client mode (hivemind's:
    it dials out only, and no one waits on it) and its gradient averager with it. None when the
    coordinator cannot say."""
    try:
        with socket.create_server((host, options.port)) as stage, socket.create_server((host, options.dht_port)) as dht:
            announced = announce_address(host, stage.getsockname()[1], options.announce_host)
            name, dht_port = announced.rpartition(":")[0], dht.getsockname()[1]
            maddr = f"/ip6/{name.strip('[]')}/tcp/{dht_port}" if ":" in name else f"/ip4/{name}/tcp/{dht_port}"
            return dial_back(options.coordinator, options.join_token, announced, [maddr], timeout=15)
    except (OSError, ConfigError):  # a port taken, a coordinator not up: the start says so itself, later
        return None


def unreachable(found: dict | None) -> bool:
    return found is not None and found.get("reach") == "unreachable"


class Announcing(Protocol):
    """The peer whose reach is checked: its record, name and stage service's port, and how it announces."""

    record: PeerRecord
    port: int

    @property
    def name(self) -> str: ...

    def announce(self, timeout: float | None = ..., **update) -> None: ...


class PeerReach:
    """Checks that others can dial one peer, serves it through a relay when nobody can, and runs the
    relay it offers others (`--relay`)."""

    def __init__(self, peer: Announcing, run: RunConfig, dht, options: PeerOptions, member: Member | None):
        self.peer, self.run, self.dht, self.options, self.member = peer, run, dht, options, member
        self.relay: RelayLink | None = None  # when nobody can dial this peer: its stream to a relay
        self.relay_server = None  # with --relay: the relay it runs for others

    def address(self) -> str:
        """The stage service's address to announce: the relay's, when it serves through one."""
        if self.relay and self.relay.address:
            return self.relay.address
        return announce_address(self.options.host, self.peer.port, self.options.announce_host)

    def check(self, before: dict | None = None) -> None:
        """Ask the coordinator to dial this peer back (coordinator/api_reachability.py); announce what it
        found, and when nobody can reach this peer, say what to change. `before`: its answer before this
        peer served (`reach_before_serving`). When that found this machine unreachable and there is a
        relay, the peer goes to the relay at once: a second dial-back of a machine nobody can dial waits
        out a connect timeout (DIAL_TIMEOUT_S) for the same answer."""
        r = self.peer.record
        if unreachable(before) and (before.get("relay") or any_relay(self.dht, self.run)):
            self.peer.announce(reach=before["reach"])
            self.serve_through(before.get("relay"))
            return
        try:
            found = dial_back(self.options.coordinator, self.options.join_token, r.address, r.dht_addrs)
        except ConfigError as err:
            log.warning(f"peer {self.peer.name}: reachability not checked: {err}")
            return
        self.peer.announce(reach=found["reach"])
        if found["reach"] == "direct":
            log.info(f"peer {self.peer.name}: reachable: the coordinator dialled {r.address} back")
            return
        if found.get("relay") or any_relay(self.dht, self.run):
            self.serve_through(found.get("relay"))
            return
        failed = [d for d in [found["stage"], *found["dht"]] if d["reach"] != "direct"]
        dht_port = next((m.group(1) for a in r.dht_addrs if (m := re.search(r"/tcp/(\d+)", a))), "PORT")
        log.warning(
            f"peer {self.peer.name}: UNREACHABLE: the coordinator, dialling from outside, could not connect to "
            + ", ".join(f"{d['target']} ({d['error']})" for d in failed)
            + ". Trainers will not send this peer work. Behind a home router: forward TCP ports "
            f"{self.peer.port} (stage) and {dht_port} (DHT) to this machine and start it with --port {self.peer.port} "
            f"--dht-port {dht_port} --announce-host YOUR_PUBLIC_IP; or open those ports in this machine's firewall."
        )

    def serve_through(self, coordinator_relay: str | None) -> None:
        """Nobody can dial this peer: keep a stream open to a relay (the peers' started with --relay, in
        random order, then the coordinator's), and announce the address it gives; when that relay
        goes, the next one."""
        host = self.options.host if self.options.host not in ("", "0.0.0.0", "::") else "127.0.0.1"

        def relays() -> list[tuple[str, str | None]]:
            view = read_swarm(self.dht, self.run.run_id, self.run.stages.count)
            mine = self.peer.record.peer_id
            found = [(p.relay, p.peer_id) for s in view.stages for p in s if p.relay and p.peer_id != mine]
            random.shuffle(found)
            return found + ([(coordinator_relay, None)] if coordinator_relay else [])

        def relayed(address: str) -> None:
            log.info(f"peer {self.peer.name}: relayed: trainers reach it at {address}")
            self.peer.announce(address=address, reach="relayed")

        log.info(f"peer {self.peer.name}: not reachable from outside; serving through a relay")
        opts = self.options
        self.relay = RelayLink(relays, (host, self.peer.port), relayed, opts.join_token, self.member).start()

    def run_relay(self, capacity: int) -> None:
        """Relay up to `capacity` peers nobody can dial (`--relay`), over mutual TLS with the run's
        certificates (members only), and announce where."""
        if self.peer.record.reach != "direct":
            log.warning(f"peer {self.peer.name}: --relay: nobody else can dial this peer either, so it relays no one")
            return
        hub = RelayHub(self.options.host, self.options.announce_host, capacity, self.member.refusal)
        self.relay_server, port = start_relay(hub, 0, self.member.server_credentials())
        where = announce_address(self.options.host, port, self.options.announce_host)
        self.peer.announce(relay=where)
        log.info(f"peer {self.peer.name}: relaying up to {capacity} peers nobody can dial, at {where}")
