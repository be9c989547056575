"""Reachability (coordinator/api_reachability.py): the coordinator dials a serving peer back.

On loopback: what it answers and refuses. In the emulated internet (benchmarks/net.py): a peer on a
public node is reported `direct`; a peer on a home node (no connection in) is reported
`unreachable`, says which ports to forward, and trainers send it nothing while the run goes on.
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import httpx
import pytest

from benchmarks.net import Internet, unavailable
from swarm.children import Proc, stop_all
from swarm.ready import CoordinatorReady, wait_ready
from tests.processes import ROOT, wait_for_state
from tests.test_speedtest import TOKEN, coordinator  # noqa: F401 (a fixture)
from tests.test_swarm import TINY

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


@pytest.mark.skipif(unavailable() is not None, reason=f"no emulated internet here: {unavailable()}")
def test_a_peer_behind_a_home_router_is_told_it_is_unreachable_and_the_run_goes_on_without_it(tmp_path: Path):
    with Internet() as net:
        nodes = {"coordinator": net.add("coordinator"), "trainer": net.add("trainer", home=True)}
        nodes |= {name: net.add(name, home=name == "home") for name in ("p0", "p1", "home")}
        procs: list[Proc] = []

        def start(name: str, args: list[str], **options) -> Proc:
            proc = Proc(args, tmp_path / f"{name}.log", cwd=ROOT, prefix=nodes[name].prefix(), **options)
            procs.append(proc)
            return proc

        try:
            host = nodes["coordinator"].address
            coordinator = start(
                "coordinator",
                ["coordinator", "--config", str(TINY), "--host", host, "--port", "8000", "--dht-port", "0"]
                + ["--state-dir", str(tmp_path / "state")],
                ready=True,
            )
            url = wait_ready(coordinator, CoordinatorReady, timeout=60).url
            for name, stage in (("p0", 0), ("p1", 1), ("home", 1)):
                start(
                    name,
                    ["peer", "--coordinator", url, "--stage", str(stage), "--host", nodes[name].address]
                    + ["--no-rebalance", "--threads", "1", "--public-name", name],
                    env={"SWARM_CHECKPOINT_DIR": str(tmp_path / name)},
                )

            def reach(state: dict) -> dict[str, str]:
                return {p["public_name"]: p["reach"] for s in state["stages"] for p in s["peers"]}

            get = nodes["trainer"].get_json
            known = lambda s: len(reach(s)) == 3 and "unknown" not in reach(s).values()  # noqa: E731
            state = wait_for_state(url, known, 120, get=get)
            assert reach(state) == {"p0": "direct", "p1": "direct", "home": "unreachable"}, reach(state)
            said = (tmp_path / "home.log").read_text()
            assert "UNREACHABLE" in said and re.search(r"forward TCP ports \d+ \(stage\) and \d+ \(DHT\)", said), said
            # A trainer behind a home router too: it dials out, so it trains; never through the home peer.
            log = tmp_path / "train.jsonl"
            trainer = start("trainer", ["train", "--coordinator", url, "--steps", "3", "--log-json", str(log)])
            assert trainer.popen.wait(300) == 0, trainer.output()[-3000:]
            assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [0, 1, 2]
            assert json.loads(log.read_text().splitlines()[-1])["failures"] == 0  # nobody called the home peer

            def served(state: dict) -> dict[str, int]:
                return {p["public_name"]: p["samples_served"] for s in state["stages"] for p in s["peers"]}

            state = wait_for_state(url, lambda s: served(s)["p1"] > 0, 30, get=get)
            assert served(state)["home"] == 0, served(state)
        finally:
            stop_all(procs)
