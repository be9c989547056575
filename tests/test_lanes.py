"""Pinned paths (`[averaging] paths = "pinned"`, DiLoCo): a trainer's SwarmCaller over two real stage-1
workers on loopback (mutual TLS, a real DHT node) sends the microbatches of each stage-0 replica on to
one stage-1 replica, a different one for each, and moves a lane when its replica goes."""

from __future__ import annotations

import torch

from coordinator.ca import RunCA
from peer.service import start_server
from peer.worker import StageWorker
from swarm.config import load_config
from swarm.records import make_dht, shutdown_dht
from swarm.trainer import Membership, SwarmCaller
from swarm.verify import SpotChecks
from swarm.wire import encode
from tests.conftest import CONFIGS
from tests.harness import swarm_fixture
from tests.test_liveness import route


@swarm_fixture
def two_replicas(tmp_path):
    """Two real stage-1 workers and a SwarmCaller whose run pins DiLoCo's paths. Yields (caller,
    {peer id: address}, {peer id: gRPC server})."""
    plain = load_config(CONFIGS / "tiny.toml")
    averaging = plain.averaging.model_copy(update={"mode": "diloco", "paths": "pinned"})
    run = plain.model_copy(update={"averaging": averaging})
    ca = RunCA.load_or_create(tmp_path, run.run_id)
    dht = make_dht()
    workers, servers, addresses = [], {}, {}
    for _ in range(2):
        worker = StageWorker(plain, 1, torch.device("cpu"))
        member = ca.member("peer")
        server, _, port = start_server(worker, "127.0.0.1", 0, member=member)
        workers.append(worker)
        servers[member.peer_id] = server
        addresses[member.peer_id] = f"127.0.0.1:{port}"
    members = Membership(run, dht, [], SpotChecks(run.stages.count, 0.0), refresh_s=3600.0)
    caller = SwarmCaller(run, members, lambda note: None, ca.member("trainer"), call_timeout=30.0)
    yield caller, addresses, servers
    caller.close()
    members.close()
    for server in servers.values():
        server.stop(0)
    for worker in workers:
        worker.close()
    shutdown_dht(dht)


def evaluate(caller: SwarmCaller, after: str) -> str:
    """One evaluation forward of stage 1 (the last stage of tiny.toml) for a microbatch that the stage-0
    replica `after` served; which stage-1 replica answered."""
    run = caller.run
    x = encode(torch.randn(2, run.model.seq_len, run.model.d_model))
    targets = encode(torch.randint(0, run.model.vocab_size, (2, run.model.seq_len)))
    _, peer = caller.forward(
        1, 2, "0.0", False, lambda c, train: c.forward(1, x, "probe", 0, targets=targets, train=train), after=after
    )
    return peer


def test_each_stage_zero_replica_feeds_one_stage_one_replica_of_its_own(two_replicas):
    caller, addresses, servers = two_replicas
    route(caller, 0, {"a0": "127.0.0.1:1", "b0": "127.0.0.1:2"})  # stage 0 as the DHT lists it (not called)
    route(caller, 1, addresses)
    fed: dict[str, set[str]] = {"a0": set(), "b0": set()}
    for _ in range(6):  # interleaved, as microbatches of both come in
        for after, peers in fed.items():
            peers.add(evaluate(caller, after))
    assert all(len(peers) == 1 for peers in fed.values()), fed
    assert fed["a0"] != fed["b0"] and fed["a0"] | fed["b0"] == set(addresses), fed

    # a0's replica of stage 1 goes: a0's lane moves to the one left, and stays there.
    (gone,) = fed["a0"]
    servers[gone].stop(0)
    route(caller, 1, {p: a for p, a in addresses.items() if p != gone})
    assert {evaluate(caller, "a0") for _ in range(4)} == fed["b0"]
    # b0's replica of stage 0 goes: its lane ends; a0's goes on.
    route(caller, 0, {"a0": "127.0.0.1:1"})
    assert evaluate(caller, "a0") in fed["b0"] and caller.lanes.taken(1) == fed["b0"]
