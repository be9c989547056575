"""Per-stage gradient averaging: what a peer hands to the average (pure, real tensors); then with
real processes: replicas stay equal, late joiners take the stage's state, and an unequal swarm
rebalances close to the best assignment."""

from __future__ import annotations

import time

import pytest
import torch
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from benchmarks.rebalance import best_min_total, stage_totals
from peer.averaging import ReplicaCheck, SwarmUpdater, clip_contribution, drop_grads, grads_finite
from swarm.client import StageClient
from swarm.config import load_config
from swarm.data import TokenStream
from swarm.model import Stage, build_stages, lm_loss
from swarm.records import TTL_S, make_dht, shutdown_dht, visible_maddrs
from swarm.wire import decode, encode
from tests.processes import wait_for_state
from tests.test_swarm import TINY, Swarm, online_names, peer_record, state

FAST_AVERAGING = "\n[averaging]\nmatchmaking_time_s = 0.5\nrequest_timeout_s = 0.3\n"
RUN = load_config(TINY)


# -- what a peer hands to the average (no network) --------------------------------------------


def flat_grad(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in module.parameters()])


def set_grad(module: torch.nn.Module, flat: torch.Tensor) -> None:
    for p, g in zip(module.parameters(), flat.split([p.numel() for p in module.parameters()]), strict=True):
        p.grad = g.view_as(p).clone()


def honest_gradients(peers: int) -> list[torch.Tensor]:
    """Stage 1's gradient of the tiny model on `peers` different micro-batches of real text."""
    first, last = build_stages(RUN)
    data = TokenStream.from_config(RUN.data, RUN.model.seq_len, RUN.training.seed)
    grads = []
    for i in range(peers):
        batch = data.microbatch(0, i, RUN.training.micro_batch)
        last.zero_grad(set_to_none=True)
        lm_loss(last(first(batch.inputs).detach()), batch.targets).backward()
        grads.append(flat_grad(last))
    return grads


def test_a_contribution_longer_than_the_bound_is_clipped_to_it_and_a_shorter_one_is_left_alone():
    module = Stage(RUN, 1)
    g = torch.randn(sum(p.numel() for p in module.parameters()), generator=torch.Generator().manual_seed(0))
    set_grad(module, g * (25.0 / g.norm()))
    assert clip_contribution(module, 10.0) == pytest.approx(0.4, rel=1e-5)
    clipped = flat_grad(module)
    assert clipped.norm() == pytest.approx(10.0, rel=1e-5)
    assert torch.allclose(clipped, g * (10.0 / g.norm()), rtol=1e-4, atol=1e-7)  # same direction
    set_grad(module, g * (3.0 / g.norm()))
    assert clip_contribution(module, 10.0) == 1.0 and torch.equal(flat_grad(module), g * (3.0 / g.norm()))
    set_grad(module, g * 1e6)
    assert clip_contribution(module, 0.0) == 1.0 and torch.equal(flat_grad(module), g * 1e6)  # 0: no bound


def test_one_peers_huge_gradient_does_not_take_over_the_stages_average():
    """Four honest peers and one whose finite gradient is 10^4 times too long, averaged with equal
    weights: unclipped, the average points where the bad one does; clipped at the run's bound
    (averaging.contribution_clip x training.grad_clip), it stays with the honest mean, and the
    honest contributions themselves are not clipped."""
    bound = RUN.averaging.contribution_clip * RUN.training.grad_clip
    honest = honest_gradients(4)
    bad = torch.randn(honest[0].numel(), generator=torch.Generator().manual_seed(1)) * honest[0].norm() * 1e4
    honest_mean = torch.stack(honest).mean(0)
    module = Stage(RUN, 1)

    def contribution(g: torch.Tensor) -> tuple[torch.Tensor, float]:
        set_grad(module, g)
        factor = clip_contribution(module, bound)
        return flat_grad(module), factor

    clipped = [contribution(g) for g in [*honest, bad]]
    assert [f for _, f in clipped[:4]] == [1.0] * 4 and clipped[4][1] < 1e-3
    cos = torch.nn.functional.cosine_similarity
    unguarded = torch.stack([*honest, bad]).mean(0)
    guarded = torch.stack([g for g, _ in clipped]).mean(0)
    assert cos(unguarded, honest_mean, dim=0) < 0.05
    assert cos(guarded, honest_mean, dim=0) > 0.8
    assert guarded.norm() <= bound


def test_a_non_finite_gradient_is_left_out_of_the_average():
    module = Stage(RUN, 1)
    for bad in (float("nan"), float("inf"), 1e30):  # 1e30 is finite, but its norm is not
        set_grad(module, torch.ones(sum(p.numel() for p in module.parameters())))
        assert grads_finite(module)
        next(module.parameters()).grad.view(-1)[7] = bad
        assert not grads_finite(module)
        drop_grads(module)
        assert grads_finite(module) and not flat_grad(module).any()


def config_with(tmp_path, extra: str):
    path = tmp_path / "run.toml"
    path.write_text(TINY.read_text() + extra)
    return path, load_config(path)


def parameters(run, record: dict) -> tuple[int, dict[str, torch.Tensor]]:
    client = StageClient(record["address"], run)
    try:
        response = client.parameters(record["stage"])
    finally:
        client.close()
    return response.optimizer_steps, {p.name: decode(p.tensor) for p in response.parameters}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


@pytest.fixture
def averaging_swarm(tmp_path):
    path, run = config_with(tmp_path, FAST_AVERAGING)
    swarm = Swarm(tmp_path, path)
    swarm.run = run
    yield swarm
    swarm.close()


def test_a_replica_told_its_weights_differ_loads_the_stages_state_at_most_once_per_step(tmp_path):
    """Two real replicas of stage 1 with equal weights; a third DHT member publishes a majority digest
    that neither holds. Replica a believes it diverged and loads the stage's state from b, which brings
    nothing new; for the rest of the step it must not download the state again and again (the worker
    asks `behind` before every request)."""
    _, run = config_with(tmp_path, FAST_AVERAGING)
    first = make_dht()
    others = [make_dht(visible_maddrs(first), record_key=RSAPrivateKey()) for _ in range(2)]
    notes: list[str] = []
    a = SwarmUpdater(run, 1, Stage(run, 1), first, note=notes.append)
    b = None
    try:
        a.load_state()  # what a starting peer does: alone, it keeps the seeded init and publishes its digest
        b = SwarmUpdater(run, 1, Stage(run, 1), others[0])
        b.load_state()  # b joins and takes a's state
        liar = others[1]
        for fake in ("0", "1", "2"):  # subkeys that sort before any real peer id
            liar.store(a.check.key, subkey=fake, value=[0, "f" * 32], expiration_time=get_dht_time() + TTL_S)
        loads, deadline = 0, time.monotonic() + ReplicaCheck.WAIT_S + 3.0
        while time.monotonic() < deadline:
            if a.behind(0):
                a.load_state()
                loads += 1
            time.sleep(0.05)
        assert any("differ from the other replicas" in n for n in notes), notes
        assert loads == 1, f"{loads} loads of the stage's state within one step"
    finally:
        for replica in (a, b):
            if replica is not None:
                replica.close()
        for dht in (first, *others):
            shutdown_dht(dht)


def test_replicas_stay_equal_and_a_late_joiner_serves_the_current_weights(averaging_swarm):
    swarm, run, steps = averaging_swarm, averaging_swarm.run, 6
    names = {"a0": 0, "b0": 0, "a1": 1, "b1": 1}
    for name, stage in names.items():
        swarm.add_peer(name, stage)
    swarm.wait_online(list(names))
    swarm.train(steps=steps)
    records = swarm.finish_training()
    assert [r["step"] for r in records] == list(range(steps))

    s = state(swarm.url)
    # The stages started from the seeded init, and the records say so.
    assert {peer_record(s, n)["weights_from"] for n in names} == {"the seeded init"}
    held = {name: parameters(run, peer_record(s, name)) for name in names}
    for a, b in (("a0", "b0"), ("a1", "b1")):
        assert held[a][0] == held[b][0] == steps, f"{a} and {b} took {held[a][0]} and {held[b][0]} steps"
        assert max_difference(held[a][1], held[b][1]) <= 1e-6, f"{a} and {b} drifted apart"
    # ... and they did train: the weights moved away from the seeded init.
    init = dict(Stage(run, 1).named_parameters())
    assert max_difference({n: t.detach() for n, t in init.items()}, held["a1"][1]) > 1e-3

    # A peer joining now takes the stage's weights, optimizer state and step from the others.
    swarm.add_peer("late1", 1)
    s = swarm.wait_online(["late1"])
    late = peer_record(s, "late1")
    assert late["weights_from"] == f"peers of stage 1 at step {steps}", late
    assert late["optimizer_steps"] == steps

    assert max_difference(parameters(run, late)[1], held["a1"][1]) <= 1e-6

    # Its first served forward gives what an old replica gives for the same input.
    x = torch.randn(2, run.model.seq_len, run.model.d_model)
    targets = encode(torch.randint(0, run.model.vocab_size, (2, run.model.seq_len)))
    outputs = {}
    for name in ("late1", "a1"):
        client = StageClient(peer_record(s, name)["address"], run)
        try:
            response = client.forward(1, encode(x), f"probe-{name}", steps, targets=targets, train=False)
        finally:
            client.close()
        outputs[name] = response.loss
    assert outputs["late1"] == pytest.approx(outputs["a1"], abs=1e-6), outputs


def test_unequal_peers_rebalance_to_within_ten_percent_of_the_best_assignment(tmp_path):
    period = 4.0
    path, _ = config_with(tmp_path, f"\n[rebalance]\nperiod_s = {period}\n")
    swarm = Swarm(tmp_path, path)
    # The delay stands in for a slower device: it lowers the throughput the peer measures.
    delays = {"u0": 0.0, "u1": 0.02, "u2": 0.05, "u3": 0.1}
    try:
        for name, delay in delays.items():
            swarm.add_peer(name, 0, "--delay-per-sample", str(delay), rebalance=True)
        swarm.wait_online(list(delays))
        speeds = {p["public_name"]: p["throughput"] for st in state(swarm.url)["stages"] for p in st["peers"]}
        assert speeds["u0"] > 1.5 * speeds["u3"], speeds
        optimum = best_min_total(list(speeds.values()), 2)

        # Every move needs one check period (randomised up to 1.5x) and a join on the new stage.
        def settled(s: dict) -> bool:
            return len(online_names(s)) == 4 and min(stage_totals(s)) >= 0.9 * optimum

        s = wait_for_state(swarm.url, settled, timeout=4 * 1.5 * period + 40)
        moves = sum(p.output().count("moving from stage") for p in swarm.peers.values())
        time.sleep(3 * period)  # the swarm is unchanged: nobody moves again
        assert sum(p.output().count("moving from stage") for p in swarm.peers.values()) == moves
        assert min(stage_totals(state(swarm.url))) >= 0.9 * optimum, (stage_totals(s), optimum, speeds)
    finally:
        swarm.close()
