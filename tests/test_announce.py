"""Announced addresses: what a coordinator and a peer tell others to dial when that is not the
address they listen on (a router's address behind NAT, a host's address for a container)."""

from __future__ import annotations

import httpx

from swarm.records import read_stage, shutdown_dht
from tests.harness import Swarm
from tests.processes import free_port, member_dht


def peer_record(state: dict, name: str) -> dict:
    return next(p for s in state["stages"] for p in s["peers"] if p["public_name"] == name)


def test_coordinator_and_peer_announce_the_given_host_and_trainers_dial_it(processes, tmp_path):
    coordinator_dht = free_port()
    listen_all = ("--host", "0.0.0.0", "--announce-host", "127.0.0.1")
    swarm = Swarm(tmp_path, coordinator_args=(*listen_all, "--dht-port", str(coordinator_dht)))
    try:
        join = httpx.get(f"{swarm.url}/api/v1/join", timeout=5).json()
        # only the announced address is handed out, not one per interface of the machine
        assert [p.split("/p2p/")[0] for p in join["initial_peers"]] == [f"/ip4/127.0.0.1/tcp/{coordinator_dht}"]

        peer_dht, peer_port = free_port(), free_port()
        swarm.add_peer("far", 0, *listen_all, "--port", str(peer_port), "--dht-port", str(peer_dht))
        swarm.add_peer("near", 1)
        state = swarm.wait_online(["far", "near"])
        far = peer_record(state, "far")
        assert far["address"] == f"127.0.0.1:{peer_port}"
        # The DHT addresses are for members (the public state lists none): read from the DHT as one.
        reader = member_dht(swarm.url)
        try:
            (record,) = [r for r in read_stage(reader, "tiny", 0) if r.public_name == "far"]
        finally:
            shutdown_dht(reader)
        assert [a.split("/p2p/")[0] for a in record.dht_addrs] == [f"/ip4/127.0.0.1/tcp/{peer_dht}"]

        swarm.train(steps=2)  # the trainer reaches the peer at its announced address
        assert [r["step"] for r in swarm.finish_training()] == [0, 1]
    finally:
        swarm.close()
