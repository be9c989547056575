"""The emulated internet (benchmarks/net.py): namespaces, shaped links, home nodes that take no
connection in, and a real swarm whose every process sits on a node of its own.

These need root, iproute2 and nftables (tests/install-tools.sh installs them; CI runs as root) and
skip, saying which is missing, where a network namespace cannot be made.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.net import PREFIX, Internet, NetSwarm, by_name, namespaces, sh, unavailable
from swarm.ready import CoordinatorReady, wait_ready
from swarm.zygote import Forked
from tests.harness import TINY
from tests.processes import ForkedProc

WHY = unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no emulated internet here: {WHY}")

# One end listens and counts what arrives; it prints the Mbit/s from its first byte to its last.
SINK = """
import socket, sys, time
s = socket.socket(); s.bind((sys.argv[1], 9000)); s.listen(); print("ready", flush=True)
c, _ = s.accept(); n, first = 0, None
while (d := c.recv(1 << 16)):
    first = first or time.perf_counter(); n += len(d)
print(n, n * 8 / (time.perf_counter() - first) / 1e6, flush=True)
"""
SEND = """
import socket, sys
c = socket.create_connection((sys.argv[1], 9000), timeout=float(sys.argv[3]))
c.sendall(b"x" * int(sys.argv[2])); c.close()
"""


def sink(node) -> subprocess.Popen:
    proc = subprocess.Popen(
        [*node.prefix(), sys.executable, "-c", SINK, node.address], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


def send(node, to, nbytes: int, timeout: float = 10) -> subprocess.CompletedProcess:
    return node.run(sys.executable, "-c", SEND, to.address, str(nbytes), str(timeout), timeout=60)


def test_a_nodes_link_carries_what_it_was_given_each_way(processes):
    with Internet() as net:
        home = net.add("home", up_mbit=20, down_mbit=80)
        server = net.add("server")
        received = sink(server)
        assert send(home, server, 4_000_000).returncode == 0
        nbytes, mbit = received.communicate(timeout=30)[0].split()
        assert int(nbytes) == 4_000_000 and 14 < float(mbit) < 24, f"uplink {mbit} Mbit/s, shaped to 20"
        received = sink(home)
        assert send(server, home, 8_000_000).returncode == 0
        mbit = float(received.communicate(timeout=30)[0].split()[1])
        assert 56 < mbit < 96, f"downlink {mbit} Mbit/s, shaped to 80"


def test_a_home_node_dials_out_and_takes_no_connection_in(processes):
    with Internet() as net:
        home, server = net.add("home", home=True), net.add("server")
        received = sink(server)
        assert send(home, server, 1000).returncode == 0  # out: fine
        assert received.communicate(timeout=30)[0].split()[0] == "1000"
        waiting = sink(home)
        refused = send(server, home, 1000, timeout=2)
        assert refused.returncode != 0 and "timed out" in refused.stderr, refused.stderr
        waiting.kill()


def test_everything_made_is_removed_also_on_failure_and_after_a_killed_run(processes):
    with pytest.raises(RuntimeError), Internet() as net:
        net.add("a"), net.add("b", up_mbit=10)
        tag = net.tag
        assert sum(ns.startswith(tag) for ns in namespaces()) == 3  # core, a, b
        raise RuntimeError("a test failing half-way")
    assert not [ns for ns in namespaces() if ns.startswith(tag)]
    # A run killed before it could clean up: its pid is gone, its namespaces are not.
    orphan = f"{PREFIX}99999999-0-core"  # above any pid_max: no process has that pid
    sh("ip", "netns", "add", orphan)
    with Internet():
        assert orphan not in namespaces()


def test_bad_nodes_are_refused_with_the_reason(processes):
    with Internet() as net:
        net.add("a")
        for name, options, words in [
            ("a", {}, "not taken"),
            ("Bad_Name", {}, "a-z"),
            ("core", {}, "not 'core'"),
            ("b", {"up_mbit": 0}, "up_mbit 0"),
            ("c", {"down_mbit": 1e9}, "down_mbit"),
        ]:
            with pytest.raises(ValueError, match=words):
                net.add(name, **options)


def test_a_swarm_trains_with_every_process_on_a_node_of_its_own(processes, tmp_path: Path):
    with Internet() as net:
        nodes = {name: {"up_mbit": 200, "down_mbit": 200} for name in ("coordinator", "p0", "p1", "trainer")}
        with NetSwarm(net, tmp_path, TINY, nodes, kind=ForkedProc) as swarm:
            assert swarm.coordinator() == f"http://{swarm.nodes['coordinator'].address}:8000"
            swarm.peer("p0", 0)
            swarm.peer("p1", 1)
            steps = swarm.train(4)
            assert [s["step"] for s in steps] == list(range(4)), steps
            state = swarm.state(lambda s: len(by_name(s, "address")) == 2, 30)
            assert by_name(state, "address")["p1"].startswith(swarm.nodes["p1"].address + ":")


def test_a_command_forked_from_the_zygote_into_a_node_serves_from_the_nodes_namespace(processes, tmp_path: Path):
    """swarm/zygote.py: a command under `ip netns exec NS` is forked into NS, as the prefix would run
    it. The coordinator binds the node's address, which exists only in the node's namespace."""
    with Internet() as net:
        node = net.add("coordinator")
        args = ["coordinator", "--config", str(TINY), "--host", node.address, "--port", "8000", "--dht-port", "0"]
        proc = ForkedProc(
            [*args, "--state-dir", str(tmp_path / "state")], tmp_path / "c.log", ready=True, prefix=node.prefix()
        )
        try:
            assert isinstance(proc.popen, Forked)
            ready = wait_ready(proc, CoordinatorReady, timeout=60)
            assert ready.url == f"http://{node.address}:8000"
            inode = os.stat(f"/proc/{proc.popen.pid}/ns/net").st_ino
            assert inode == os.stat(f"/run/netns/{node.ns}").st_ino != os.stat("/proc/self/ns/net").st_ino
            assert node.get_json(f"{ready.url}/api/v1/state")["run_id"] == "tiny"
        finally:
            proc.stop()
