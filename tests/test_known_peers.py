"""The DHT addresses a coordinator keeps for its restart (coordinator/known_peers.py): bounded."""

from __future__ import annotations

from pathlib import Path

from coordinator.known_peers import ADDRS_PER_PEER, KEEP_PEERS, KnownPeers
from swarm.records import PeerRecord, SwarmView


def record(i: int, started: float, addresses: int = 10, state: str = "online") -> PeerRecord:
    addrs = [f"/ip4/10.{i // 256}.{i % 256}.{j}/tcp/31337" for j in range(addresses)]
    return PeerRecord(peer_id=f"p{i:04}", stage=i % 2, address="x:1", state=state, started=started, dht_addrs=addrs)


def view(records: list[PeerRecord]) -> SwarmView:
    return SwarmView(stages=[[r for r in records if r.stage == k] for k in range(2)], trainers=[], read_at=0.0)


def peers_of(addrs: list[str]) -> set[int]:
    return {int(a.split("/")[2].split(".")[1]) * 256 + int(a.split("/")[2].split(".")[2]) for a in addrs}


def test_the_file_keeps_a_few_addresses_of_each_of_the_peers_online_longest(tmp_path: Path):
    path = tmp_path / "peers.json"
    records = [record(i, started=1000.0 - i) for i in range(300)]  # the later i, the earlier it started
    records.append(record(300, started=0.0, state="leaving"))  # not online: not a way in
    KnownPeers(path).update(view(records))
    saved = KnownPeers(path).load()
    assert len(saved) == KEEP_PEERS * ADDRS_PER_PEER
    assert peers_of(saved) == set(range(300 - KEEP_PEERS, 300))


def test_a_record_with_a_flood_of_addresses_adds_only_a_few(tmp_path: Path):
    path = tmp_path / "peers.json"
    known = KnownPeers(path)
    known.update(view([record(0, started=1.0), record(1, started=0.0, addresses=100_000)]))
    saved = KnownPeers(path).load()
    assert len(saved) == 2 * ADDRS_PER_PEER and peers_of(saved) == {0, 1}
    assert path.stat().st_size < 2000
