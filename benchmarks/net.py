"""An emulated internet on one machine, for tests and benchmarks that must cross a real network.

Every node (a coordinator, a peer, a trainer) lives in a network namespace of its own, joined by a
veth pair to a bridge in a core namespace: each node has its own address (10.213.0.N/16), its own
loopback, and sees the others only across the bridge. Per node, what its link carries:
`up_mbit` shapes what it sends (a tbf qdisc on its end of the veth), `down_mbit` what it receives
(a tbf qdisc on the core's end). A `home` node is a volunteer behind a router: it dials out, and
an nftables rule in its namespace drops every new connection coming in, as a NAT without port
forwarding does. The kernel here has no netem, so links add no latency: a round trip across the
bridge takes tens of microseconds.

Needs root, iproute2 and nftables (`tests/install-tools.sh` installs the last two with apt);
`unavailable()` says why when it cannot work here. Namespaces are named after this process
(`swnet<pid>-<k>-<node>`), and `Internet.close()` (also on an exception, and at exit) deletes every one
it made, with the veths and bridge in them; a run that was killed leaves namespaces whose pid is
gone, and the next `Internet` deletes those first.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import re
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from swarm.children import Proc, stop_all
from swarm.ready import CoordinatorReady, wait_ready
from swarm.zygote import enter_netns

PREFIX = "swnet"
SUBNET = "10.213"  # a private range, only ever inside the namespaces made here
BRIDGE = "br0"
ROOT = Path(__file__).resolve().parent.parent  # the repository: where `python -m swarm.cli` runs
_count = itertools.count()


class NetError(RuntimeError):
    """A namespace, link or rule that could not be made; the message has the command and its error."""


def sh(*args: str, stdin: str | None = None) -> str:
    done = subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise NetError(f"{' '.join(args)}: {done.stderr.strip() or done.stdout.strip() or done.returncode}")
    return done.stdout


def unavailable() -> str | None:
    """Why an emulated internet cannot be made on this machine (None: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (run the tests as root, as CI does)"
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"{tool} is missing: install Debian's {package} (tests/install-tools.sh does)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        sh("ip", "netns", "add", probe)
    except NetError as err:
        return f"cannot create a network namespace here ({err})"
    with contextlib.suppress(NetError):
        sh("ip", "netns", "del", probe)
    return None


def namespaces() -> list[str]:
    return [line.split()[0] for line in sh("ip", "netns", "list").splitlines() if line.strip()]


def sweep() -> list[str]:
    """Delete the namespaces of emulated internets whose process is gone (a run that was killed)."""
    gone = []
    for ns in namespaces():
        m = re.fullmatch(rf"{PREFIX}(\d+)-\d+-.+", ns)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            with contextlib.suppress(NetError):
                sh("ip", "netns", "del", ns)
                gone.append(ns)
    return gone


@dataclass
class Node:
    name: str
    ns: str
    address: str
    up_mbit: float | None = None
    down_mbit: float | None = None
    home: bool = False

    def prefix(self) -> list[str]:
        """What runs a command in this node: `[*node.prefix(), "python", ...]`."""
        return ["ip", "netns", "exec", self.ns]

    def run(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run([*self.prefix(), *args], capture_output=True, text=True, timeout=timeout)

    def get_json(self, url: str, timeout: float = 30) -> object:
        """GET `url` from this node (the machine's own namespace has no way into the emulated internet):
        from a thread of this process that enters the node's namespace (a network namespace is a
        thread's own), not a command run there (a new interpreter per call: the 0.2 s polls of
        `NetSwarm.state` took two thirds of a core from the swarm they watched)."""
        answer: dict[str, object] = {}

        def get() -> None:
            try:
                enter_netns(self.ns)
                r = httpx.get(url, timeout=min(timeout, 10))
                r.raise_for_status()
                answer["json"] = r.json()
            except Exception as err:  # noqa: BLE001 (reported below, in the caller's thread)
                answer["error"] = err

        reader = threading.Thread(target=get, name=f"get-{self.name}", daemon=True)
        reader.start()
        reader.join(timeout)
        if "json" not in answer:
            raise NetError(f"GET {url} from {self.name}: {answer.get('error', f'no answer in {timeout} s')}")
        return answer["json"]


def tbf(ns: str, dev: str, mbit: float) -> None:
    """Shape what `dev` sends to `mbit`: a token bucket with room for a few of the 64 KB segments
    that veth offloads pass in one piece (a smaller bucket drops them all)."""
    burst = max(256 * 1024, int(mbit * 1e6 / 8 / 100))  # at least 10 ms of the rate
    sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit", "burst", str(burst),
       "latency", "200ms")  # fmt: skip


HOME_RULES = """
table inet swarm_home {
    chain input {
        type filter hook input priority 0; policy accept;
        iifname "eth0" ct state new drop
    }
}
"""


@dataclass
class Internet:
    """Nodes on one emulated internet; a context manager that removes what it made."""

    nodes: dict[str, Node] = field(default_factory=dict)
    tag: str = ""
    core: str = ""
    made: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        sweep()
        self.tag = f"{PREFIX}{os.getpid()}-{next(_count)}"
        self.core = f"{self.tag}-core"
        self._make(self.core)
        sh("ip", "-n", self.core, "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "-n", self.core, "link", "set", BRIDGE, "up")
        atexit.register(self.close)

    def _make(self, ns: str) -> None:
        sh("ip", "netns", "add", ns)
        self.made.append(ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")

    def add(self, name: str, up_mbit: float | None = None, down_mbit: float | None = None, home: bool = False) -> Node:
        """A node named `name` (letters, digits, dashes): its namespace, its link to the bridge, its
        address, the bandwidth it sends (`up_mbit`) and receives (`down_mbit`) at (None: unshaped),
        and, when `home`, no connection coming in."""
        if not re.fullmatch(r"[a-z0-9-]{1,20}", name) or name in self.nodes or name == "core":
            raise ValueError(f"node name {name!r}: 1 to 20 of a-z, 0-9, '-', not 'core', and not taken")
        for what, mbit in (("up_mbit", up_mbit), ("down_mbit", down_mbit)):
            if mbit is not None and not 0.1 <= mbit <= 100_000:
                raise ValueError(f"{what} {mbit}: between 0.1 and 100000 Mbit/s, or None")
        index = len(self.nodes) + 1
        if index > 250:
            raise ValueError("at most 250 nodes")
        ns = f"{self.tag}-{name}"
        self._make(ns)
        wire = f"v{index}"
        sh("ip", "-n", self.core, "link", "add", wire, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "-n", self.core, "link", "set", wire, "master", BRIDGE, "up")
        address = f"{SUBNET}.0.{index}"
        sh("ip", "-n", ns, "addr", "add", f"{address}/16", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        if up_mbit is not None:
            tbf(ns, "eth0", up_mbit)
        if down_mbit is not None:
            tbf(self.core, wire, down_mbit)
        if home:
            sh("ip", "netns", "exec", ns, "nft", "-f", "-", stdin=HOME_RULES)
        node = Node(name, ns, address, up_mbit, down_mbit, home)
        self.nodes[name] = node
        return node

    def close(self) -> None:
        """Delete every namespace this internet made (their veths and the bridge go with them)."""
        while self.made:
            ns = self.made.pop()
            with contextlib.suppress(NetError):
                sh("ip", "netns", "del", ns)
        self.nodes.clear()

    def __enter__(self) -> Internet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NetSwarm:
    """A run on an emulated internet: a coordinator, peers and a trainer, each `swarm` process on a
    node of its own (`Internet.add`), logs in `tmp`. Reads the coordinator's state from the node
    `reader` (the machine's own namespace cannot reach the nodes)."""

    def __init__(
        self,
        net: Internet,
        tmp: Path,
        config: Path,
        nodes: dict[str, dict],
        reader: str = "trainer",
        kind: type[Proc] = Proc,
    ):
        """`nodes`: name -> `Internet.add` options; "coordinator" and `reader` among them. `kind`: the
        class that starts each process (a subclass may fork them all from a zygote)."""
        self.tmp, self.config, self.procs, self.kind = tmp, config, [], kind
        self.nodes = {name: net.add(name, **options) for name, options in nodes.items()}
        self.reader, self.url = reader, ""

    def start(self, name: str, args: list[str], **options):
        proc = self.kind(args, self.tmp / f"{name}.log", cwd=ROOT, prefix=self.nodes[name].prefix(), **options)
        self.procs.append(proc)
        return proc

    def coordinator(self, *extra: str) -> str:
        host = self.nodes["coordinator"].address
        args = ["coordinator", "--config", str(self.config), "--host", host, "--port", "8000", "--dht-port", "0"]
        proc = self.start("coordinator", [*args, "--state-dir", str(self.tmp / "state"), *extra], ready=True)
        self.url = wait_ready(proc, CoordinatorReady, timeout=60).url
        return self.url

    def peer(self, name: str, stage: int, *extra: str):
        args = ["peer", "--coordinator", self.url, "--stage", str(stage), "--host", self.nodes[name].address]
        args += ["--no-rebalance", "--threads", "1", "--public-name", name, *extra]
        return self.start(name, args, env={"SWARM_CHECKPOINT_DIR": str(self.tmp / name)})

    def train(self, steps: int, *extra: str, wait: bool = True, timeout: float = 300) -> list[dict]:
        log = self.tmp / "train.jsonl"
        args = ["train", "--coordinator", self.url, "--steps", str(steps), "--log-json", str(log)]
        trainer = self.start(self.reader, [*args, "--call-timeout", "20", *extra])
        if wait and trainer.popen.wait(timeout) != 0:
            raise NetError(f"the trainer failed: {trainer.output()[-3000:]}")
        return self.steps()

    def steps(self) -> list[dict]:
        """The trainer's step log so far."""
        log = self.tmp / "train.jsonl"
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    def state(self, ok, timeout: float) -> dict:
        """The coordinator's /api/v1/state once `ok` says so."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.nodes[self.reader].get_json(f"{self.url}/api/v1/state")
            if ok(state):
                return state
            if time.monotonic() > deadline:
                raise AssertionError(f"/api/v1/state did not reach the expected state within {timeout} s: {state}")
            time.sleep(0.2)

    def close(self) -> None:
        stop_all(self.procs)

    def __enter__(self) -> NetSwarm:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def by_name(state: dict, field: str) -> dict:
    """Each peer's `field` in a coordinator state, by public name."""
    return {p["public_name"]: p[field] for s in state["stages"] for p in s["peers"]}
