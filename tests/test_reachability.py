"""Reachability (coordinator/api_reachability.py): the coordinator dials a serving peer back.

On loopback: what it answers and refuses. In the emulated internet (benchmarks/net.py): a peer on a
public node is reported `direct`; a peer on a home node (no connection in) is reported
`unreachable`, says which ports to forward, and trainers send it nothing while the run goes on.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest

from benchmarks.net import Internet, NetSwarm, by_name, unavailable
from tests.harness import TINY
from tests.processes import ForkedProc
from tests.test_speedtest import TOKEN, coordinator  # noqa: F401 (a fixture)

MEMBER = {"Authorization": f"Bearer {TOKEN}"}


def ask(url: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{url}/api/v1/reachability", json=body, headers=MEMBER if headers is None else headers)


def test_a_listening_port_is_direct_and_a_closed_one_unreachable(coordinator: str):  # noqa: F811
    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        port, shut = listening.getsockname()[1], closed.getsockname()[1]
        found = ask(coordinator, {"address": f"127.0.0.1:{port}", "dht_addrs": [f"/ip4/127.0.0.1/tcp/{port}"]})
        assert found.status_code == 200 and found.json()["reach"] == "direct", found.text
        found = ask(coordinator, {"address": f"127.0.0.1:{shut}"}).json()
        assert found["reach"] == "unreachable" and found["stage"]["error"], found
        found = ask(coordinator, {"address": f"127.0.0.1:{port}", "dht_addrs": [f"/ip4/127.0.0.1/tcp/{shut}"]})
        assert found.json()["reach"] == "unreachable"  # the DHT too must be reachable


def test_the_coordinator_knocks_on_no_other_machine_and_answers_no_outsider(coordinator: str):  # noqa: F811
    elsewhere = ask(coordinator, {"address": "192.0.2.1:8000"})  # TEST-NET-1: not the asker
    assert elsewhere.status_code == 422 and "only the address the request comes from" in elsewhere.json()["detail"]
    # A DHT address elsewhere is not dialled at all: the answer lists none.
    found = ask(coordinator, {"address": "127.0.0.1:1", "dht_addrs": ["/ip4/192.0.2.1/tcp/31337"]}).json()
    assert found["dht"] == [], found
    assert ask(coordinator, {"address": "127.0.0.1:1"}, headers={}).status_code == 401
    for body, words in [
        ({"address": "127.0.0.1"}, "address"),
        ({"address": "127.0.0.1:99999"}, "port 99999"),
        ({"address": "127.0.0.1:1", "dht_addrs": ["not a multiaddr"]}, "not /ip4"),
        ({"address": "127.0.0.1:1", "dht_addrs": ["/ip4/127.0.0.1/tcp/1"] * 9}, "dht_addrs"),
        ({"address": "127.0.0.1:1", "more": 1}, "more"),
    ]:
        refused = ask(coordinator, body)
        assert refused.status_code == 422 and words in refused.text, (body, refused.text)
    assert httpx.get(f"{coordinator}/healthz").json() == {"ok": True}


NO_NET = unavailable()
needs_net = pytest.mark.skipif(NO_NET is not None, reason=f"no emulated internet here: {NO_NET}")


def emulated(net: Internet, tmp: Path, homes: set[str], names: tuple[str, ...]) -> NetSwarm:
    """A tiny.toml run: a coordinator, `names` peers and a trainer on nodes of their own; `homes` take
    no connection in."""
    nodes = {name: {"home": name in homes} for name in ("coordinator", "trainer", *names)}
    return NetSwarm(net, tmp, TINY, nodes, kind=ForkedProc)  # forked into their nodes: no interpreter each


def reported(count: int):
    """Whether a state lists `count` peers, each with its reachability known."""
    return lambda s: len(by_name(s, "reach")) == count and "unknown" not in by_name(s, "reach").values()


@needs_net
def test_a_peer_behind_a_home_router_serves_through_the_relay_and_averages_with_a_public_replica(
    processes, tmp_path: Path
):
    with Internet() as net, emulated(net, tmp_path, homes={"home", "trainer"}, names=("p0", "p1", "home")) as swarm:
        swarm.coordinator()
        for name, stage in (("p0", 0), ("p1", 1), ("home", 1)):
            swarm.peer(name, stage)
        # `home` is announced unreachable (no work for it) until its relay link gives it an address.
        state = swarm.state(lambda s: reported(3)(s) and by_name(s, "reach")["home"] != "unreachable", 120)
        assert by_name(state, "reach") == {"p0": "direct", "p1": "direct", "home": "relayed"}
        relayed = by_name(state, "address")["home"]
        assert relayed.startswith(swarm.nodes["coordinator"].address + ":"), relayed
        steps = swarm.train(4)  # a trainer behind a home router too: everyone dials out
        assert [s["step"] for s in steps] == [0, 1, 2, 3]
        state = swarm.state(lambda s: by_name(s, "samples_served")["home"] > 0, 30)
        said = (tmp_path / "home.log").read_text()
        assert "its DHT node dials out only (client mode)" in said
        # Its stage's gradients were averaged with the public replica's, home's DHT dialling out only.
        assert re.search(r"stage 1 step \d+: \d+ samples, averaged in a group of 2", said), said[-3000:]


@needs_net
def test_without_a_relay_a_peer_behind_a_home_router_is_told_what_to_forward_and_gets_no_work(
    processes, tmp_path: Path
):
    with Internet() as net, emulated(net, tmp_path, homes={"home", "trainer"}, names=("p0", "p1", "home")) as swarm:
        swarm.coordinator("--relay-capacity", "0")
        for name, stage in (("p0", 0), ("p1", 1), ("home", 1)):
            swarm.peer(name, stage)
        state = swarm.state(reported(3), 120)
        assert by_name(state, "reach") == {"p0": "direct", "p1": "direct", "home": "unreachable"}
        said = (tmp_path / "home.log").read_text()
        assert "UNREACHABLE" in said and re.search(r"forward TCP ports \d+ \(stage\) and \d+ \(DHT\)", said), said
        steps = swarm.train(3)
        assert [s["step"] for s in steps] == [0, 1, 2] and steps[-1]["failures"] == 0  # nobody called it
        state = swarm.state(lambda s: by_name(s, "samples_served")["p1"] > 0, 30)
        assert by_name(state, "samples_served")["home"] == 0


@needs_net
def test_when_its_relay_dies_a_peer_behind_a_home_router_moves_to_another_and_the_run_goes_on(
    processes, tmp_path: Path
):
    with Internet() as net, emulated(net, tmp_path, homes={"home", "trainer"}, names=("r1", "r2", "home")) as swarm:
        swarm.coordinator("--relay-capacity", "0")  # only the peers relay
        swarm.peer("r1", 0, "--relay", "2")
        swarm.peer("r2", 0, "--relay", "2")
        swarm.state(lambda s: all(by_name(s, "relay").get(n) for n in ("r1", "r2")), 120)
        swarm.peer("home", 1)  # stage 1's only peer: the run stops unless it is reachable
        state = swarm.state(lambda s: by_name(s, "reach").get("home") == "relayed", 120)
        first = by_name(state, "address")["home"]
        relay = next(n for n in ("r1", "r2") if first.startswith(swarm.nodes[n].address + ":"))
        other = "r2" if relay == "r1" else "r1"
        # Stage 1 has no other peer: no step passes until home serves through the other relay. The relay
        # is killed once the trainer has logged its first step (home served it through that relay), so
        # most of the steps come after the move.
        steps = 8
        swarm.train(steps, wait=False)
        trainer = swarm.procs[-1]
        deadline = time.monotonic() + 120
        while not swarm.steps():
            assert trainer.alive() and time.monotonic() < deadline, trainer.output()[-3000:]
            time.sleep(0.1)
        swarm.procs[[p.log_path.stem for p in swarm.procs].index(relay)].stop(signal.SIGKILL)
        killed = time.monotonic()
        done = len(swarm.steps())
        assert trainer.alive() and done < steps - 1, f"the kill came after {done} of {steps} steps: nothing was tested"
        moved = lambda s: by_name(s, "address")["home"].startswith(swarm.nodes[other].address + ":")  # noqa: E731
        swarm.state(moved, 30)
        assert time.monotonic() - killed <= 30, "a dead relay is replaced within 30 s"
        assert trainer.popen.wait(400) == 0, trainer.output()[-3000:]
        records = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == list(range(steps))
