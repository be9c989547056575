"""Spot checks: the policy (which calls, what tolerance, who is outvoted) without a network, then a
real swarm in which one peer of stage 1 corrupts its outputs and gets banned."""

from __future__ import annotations

import re

import httpx
import pytest
import torch

from coordinator.events import diff_events
from swarm.records import TrainerRecord
from swarm.routing import Router
from swarm.verify import SpotChecks, new_key, odd_one_out, one_per_host, opaque_id, relative_error, sampled, tolerance
from swarm.wire import decode, encode
from tests.conftest import run_cli
from tests.harness import ACCUMULATION, TINY, Swarm, peer_record
from tests.processes import wait_for_state
from tests.test_coordinator_api import peer, view

# With a check on half the calls and 3 peers on the stage (and every call of a new peer checked): a
# generous bound, 2 to 4 microbatches in practice, and 6 microbatches of the run come after it.
MAX_MICROBATCHES_TO_BAN = 10

# -- the policy --------------------------------------------------------------------------------


def hidden(seed: int = 0) -> torch.Tensor:
    return torch.randn(8, 128, 128, generator=torch.Generator().manual_seed(seed))


def test_the_sampled_fraction_is_close_to_the_asked_one_and_depends_on_the_trainers_secret():
    # 50 000 calls at 2 %: 1000 expected, sd 31; the bounds sit 8 sd away so that no key fails them.
    names = [f"{step}.{i}" for step in range(25_000) for i in range(2)]
    key = new_key()
    picked = [n for n in names if sampled(key, 1, n, 0.02)]
    assert 0.015 <= len(picked) / len(names) <= 0.025
    assert picked == [n for n in names if sampled(key, 1, n, 0.02)]  # the trainer's own decision repeats
    assert picked != [n for n in names if sampled(new_key(), 1, n, 0.02)]  # another secret: other calls
    assert not any(sampled(key, 1, n, 0.0) for n in names)
    assert all(sampled(key, 1, n, 1.0) for n in names)
    assert SpotChecks(1, 0.5).key != SpotChecks(1, 0.5).key  # every trainer draws its own


def test_microbatch_ids_reveal_neither_step_nor_index():
    key = new_key()
    ids = {opaque_id(key, f"{step}.{i}") for step in range(100) for i in range(4)}
    assert len(ids) == 400  # one each
    assert all(len(i) == 16 and "." not in i for i in ids)
    assert opaque_id(key, "3.1") == opaque_id(key, "3.1") != opaque_id(new_key(), "3.1")


def test_votes_count_once_per_host():
    host = {"a": "10.0.0.1", "sybil1": "10.0.0.9", "sybil2": "10.0.0.9", "b": "10.0.0.2"}.__getitem__
    assert one_per_host(["sybil1", "sybil2", "a", "b"], host) == ["sybil1", "a", "b"]
    assert one_per_host(["sybil1", "sybil2", "a", "b"], host, taken={"10.0.0.9"}) == ["a", "b"]
    assert one_per_host(["sybil2"], host, taken={"10.0.0.9", "10.0.0.1"}) == []


@pytest.mark.parametrize("codec", ["none", "fp16", "bf16", "int8"])
def test_honest_answers_through_any_codec_agree_and_corrupted_ones_do_not(codec):
    x = hidden()
    # Two honest peers: the same values up to float32 noise, each encoded by the codec.
    a = decode(encode(x, codec))
    b = decode(encode(x * (1 + 1e-6 * torch.randn_like(x)), codec))
    rtol = tolerance(codec, "float32")
    assert relative_error(a, b) <= rtol
    corrupted = decode(encode(x + 0.1 * x.pow(2).mean().sqrt() * torch.randn_like(x), codec))
    assert relative_error(a, corrupted) > rtol


def test_the_tolerance_grows_with_a_coarser_codec_and_dtype_and_the_loss_ignores_the_codec():
    assert tolerance("none", "float32") < tolerance("fp16", "float32") < tolerance("bf16", "float32")
    assert tolerance("bf16", "float32") < tolerance("int8", "float32")
    assert tolerance("none", "float32") < tolerance("none", "bfloat16")
    assert tolerance("int8", "float32", encoded=False) == tolerance("none", "float32", encoded=False)
    assert tolerance("none", "float32", encoded=False) < tolerance("none", "float32")  # a mean over all tokens


def test_non_finite_or_misshapen_answers_never_agree():
    x = hidden()
    y = x.clone()
    y[0, 0, 0] = float("nan")
    assert relative_error(x, y) == float("inf")
    assert relative_error(x, x[:4]) == float("inf")
    assert relative_error(torch.zeros(3), torch.zeros(3)) == 0.0


def test_the_odd_one_out_needs_two_others_that_agree():
    def agree(a, b):
        return relative_error(a, b) <= 1e-3

    x, y, z = hidden(0), hidden(1), hidden(2)
    assert odd_one_out([x, y, x.clone()], agree) == 1
    assert odd_one_out([y, x, x.clone()], agree) == 0
    assert odd_one_out([x, x.clone(), x.clone()], agree) is None  # all agree
    assert odd_one_out([x, y, z], agree) is None  # no majority
    assert odd_one_out([x, y], agree) is None  # two cannot tell who is wrong


def test_every_peer_is_checked_first_then_only_the_sampled_calls():
    spot = SpotChecks(1, fraction=0.0001, strikes=2, first_checks=2)
    peers = ["a", "b", "c"]
    x = hidden()
    checked, roles = [], []
    for i in range(40):
        if spot.due(0, f"{i}.0", peers):
            checker = spot.checker(0, peers, f"{i}.0")
            primary = next(p for p in peers if p != checker)
            spot.judge(0, [(primary, x), (checker, x.clone())], 1e-3)
            checked.append(i)
            roles += [primary, checker]
    # The least checked peer answers each check: every peer is checked twice (first_checks) at least.
    assert all(roles.count(p) >= 2 for p in peers), roles
    assert len(checked) <= 2 * len(peers)  # then only a 0.01% sample: none of the other calls
    assert spot.checks == len(checked) and spot.disagreements == 0
    assert not spot.due(0, "0.0", ["a"])  # one peer: nobody to compare with


def test_no_peer_is_always_the_checker_of_a_stage_of_three():
    """An inner stage of three, every call checked: a microbatch's forward goes to the fastest peer that
    is not the checker, its backward to the same peer, each checked by the peer with the fewest passes.
    With ties broken by id, "a" (the fastest, its id first) answered every forward's check and no
    training call: a liar so placed was never caught lying (a CI run saw 64 checks and no lie). Ties
    are broken by a keyed hash of the call: "a" gets training calls too."""
    spot = SpotChecks(1, fraction=1.0, strikes=1)
    peers, x = ["a", "b", "c"], hidden()  # fastest first
    trained = {p: 0 for p in peers}
    for i in range(32):
        checker = spot.checker(0, peers, f"{i}.0")
        trainer = next(p for p in peers if p != checker)
        spot.judge(0, [(trainer, x), (checker, x.clone())], 1e-3)
        checker = spot.checker(0, [p for p in peers if p != trainer], f"{i}.0/backward")
        spot.judge(0, [(trainer, x), (checker, x.clone())], 1e-3)
        trained[trainer] += 1
    assert trained["a"] >= 4, trained
    assert spot.checker(0, peers, "7.0") == spot.checker(0, peers, "7.0")  # repeatable for one trainer
    assert spot.checks == 64 and spot.disagreements == 0


def test_an_outvoted_peer_is_banned_after_its_strikes_and_the_others_never():
    spot = SpotChecks(2, fraction=1.0, strikes=2)
    x, bad = hidden(0), hidden(1)
    verdict = spot.judge(1, [("liar", bad), ("b", x)], 1e-3, arbiter=lambda: ("c", x.clone()))
    assert verdict.odd == "liar" and not verdict.banned and not spot.banned
    verdict = spot.judge(1, [("b", x), ("liar", bad)], 1e-3, arbiter=lambda: ("c", x.clone()))
    assert verdict.odd == "liar" and verdict.banned
    assert spot.banned == {"liar": 1}
    assert spot.checker(1, ["liar", "b", "c"]) != "liar"
    assert (spot.checks, spot.disagreements, spot.unresolved) == (2, 2, 0)


def test_a_ban_ends_after_ban_s_and_the_peer_starts_over_checked_on_every_call():
    spot = SpotChecks(1, fraction=0.0001, strikes=2, first_checks=1, ban_s=300)
    peers = ["a", "b", "p"]
    x, bad = hidden(0), hidden(1)
    for a in (x, x.clone()):
        spot.judge(0, [("a", a), ("b", x.clone())], 1e-3)
    for _ in range(2):  # e.g. a replica that missed its stage's all-reduce, at t = 1000 s
        spot.judge(0, [("a", x), ("p", bad)], 1e-3, arbiter=lambda: ("b", x.clone()), now=1000.0)
    assert spot.banned == {"p": 0} and spot.bans == 1
    assert spot.release(now=1299.0) == [] and spot.banned == {"p": 0}
    assert spot.release(now=1300.0) == ["p"] and spot.banned == {}
    assert spot.due(0, "7.0", peers) and spot.checker(0, peers) == "p"  # new again: every call checked
    spot.judge(0, [("a", x), ("p", x.clone())], 1e-3)  # it took the stage's state: it agrees
    assert not spot.due(0, "7.0", peers) and spot.bans == 1
    # A liar starts over too, and is banned again after its next `strikes` checks.
    for _ in range(2):
        spot.judge(0, [("a", x), ("p", bad)], 1e-3, arbiter=lambda: ("b", x.clone()), now=2000.0)
    assert spot.banned == {"p": 0} and spot.bans == 2
    assert SpotChecks(1, fraction=1.0, ban_s=0).release(now=1e12) == []  # 0: for the rest of the run


def test_an_outvoted_peer_is_checked_on_every_call_until_it_passes_again():
    spot = SpotChecks(1, fraction=0.0001, strikes=3, first_checks=1)
    peers = ["a", "b", "liar"]
    x, bad = hidden(0), hidden(1)
    spot.judge(0, [("a", x), ("b", x.clone())], 1e-3)
    spot.judge(0, [("a", x), ("liar", x.clone())], 1e-3)
    assert not spot.due(0, "7.0", peers)  # everyone passed once: back to the sample
    spot.judge(0, [("a", x), ("liar", bad)], 1e-3, arbiter=lambda: ("b", x.clone()))
    assert spot.due(0, "7.0", peers) and spot.checker(0, peers) == "liar"
    spot.judge(0, [("a", x), ("liar", x.clone())], 1e-3)
    assert not spot.due(0, "7.0", peers)


def test_two_peers_that_disagree_without_an_arbiter_ban_nobody():
    spot = SpotChecks(1, fraction=1.0, strikes=1)
    x, y = hidden(0), hidden(1)
    for _ in range(5):
        verdict = spot.judge(0, [("a", x), ("b", y)], 1e-3)
        assert not verdict.agreed and verdict.odd is None
    # an arbiter agreeing with neither settles nothing either
    spot.judge(0, [("a", x), ("b", y)], 1e-3, arbiter=lambda: ("c", hidden(2)))
    assert not spot.banned and spot.disagreements == spot.unresolved == 6


def test_the_arbiter_is_asked_only_after_a_disagreement():
    spot = SpotChecks(1, fraction=1.0)
    x = hidden()
    asked = []
    spot.judge(0, [("a", x), ("b", x.clone())], 1e-3, arbiter=lambda: asked.append(1))
    assert not asked


def test_a_check_call_releases_its_reservation_without_teaching_the_router_a_speed():
    router = Router()
    router.update_peers({"a": 10.0}, now=0.0)
    router.done("a", 8, 1.0, now=1.0)  # a training call: 8 samples/s
    assert router.pick(8, now=1.0) == "a"
    router.returned("a", 8, now=1.1)  # an evaluation forward, answered at once
    [stats] = router.stats(now=1.1)
    assert stats.outstanding == 0 and stats.throughput == 8.0


def test_a_spot_check_ban_is_an_event_naming_the_peer_and_its_stage():
    before = TrainerRecord(trainer_id="t", public_name="tr", spot_checks=3)
    after = TrainerRecord(trainer_id="t", public_name="tr", spot_checks=5, spot_bans=1, spot_banned={"liar": 1})
    peers = [peer("liar", 1), peer("b", 1)]
    [event] = diff_events(view(*peers, trainers=[before]), view(*peers, trainers=[after]))
    assert (event.kind, event.peer, event.stage) == ("ban", "name-liar", 1)
    assert event.text == "trainer tr banned peer name-liar of stage 1: its outputs disagreed with two agreeing peers"
    assert diff_events(view(*peers, trainers=[after]), view(*peers, trainers=[after])) == []


# -- a real swarm ------------------------------------------------------------------------------


def test_the_verify_fraction_option_is_a_fraction(processes):
    result = run_cli("train", "--coordinator", "http://127.0.0.1:9", "--verify-fraction", "1.5")
    assert result.returncode == 2 and "between 0 and 1" in result.stderr


def test_a_peer_corrupting_its_outputs_is_banned_and_gets_no_more_traffic(processes, tmp_path):
    config = tmp_path / "verify.toml"
    config.write_text(TINY.read_text() + "\n[verify]\nfraction = 0.5\n")
    swarm = Swarm(tmp_path, config)
    try:
        for name, stage in [("s0", 0), ("honest1", 1), ("honest2", 1)]:
            swarm.add_peer(name, stage)
        swarm.add_peer("liar", 1, "--corrupt-outputs", "0.5")
        swarm.wait_online(["s0", "honest1", "honest2", "liar"])
        steps = 8  # 16 microbatches: the ban must come by MAX_MICROBATCHES_TO_BAN, then calls go on
        swarm.train(steps=steps, inflight=4)
        records = swarm.finish_training()
        assert records[-1]["microbatches"] == steps * ACCUMULATION
        out = swarm.trainer.output()
        bans = re.findall(r"spot check: banned peer (\S+) of stage (\d+) at microbatch (\d+)\.(\d+)", out)
        s = wait_for_state(swarm.url, lambda s: peer_record(s, "liar") is not None)
        liar = peer_record(s, "liar")["peer_id"]
        assert [(peer, stage) for peer, stage, _, _ in bans] == [(liar, "1")], out[-3000:]  # honest peers never
        step, i = int(bans[0][2]), int(bans[0][3])
        banned_after = step * ACCUMULATION + i + 1
        print(f"banned after {banned_after} microbatches; {records[-1]}")
        assert banned_after <= MAX_MICROBATCHES_TO_BAN
        # No more traffic: no training microbatch of a later step reached the liar (those of its
        # step and the next may have been in flight when it was banned).
        # (A step log's "step" counts the steps taken: the step of microbatches of step s says s + 1.)
        # A liar banned by its first checks may have applied no training microbatch at all.
        applied = [s["step"] for s in swarm.applied() if s["peer"] == "liar" and s["microbatches"]]
        assert not applied or max(applied) <= step + 2, applied
        # The coordinator shows the checks and the ban, and reports it as an event naming the peer.
        s = wait_for_state(swarm.url, lambda s: any(t["spot_bans"] for t in s["trainers"]), timeout=30)
        trainer = s["trainers"][0]
        assert trainer["spot_banned"] == {liar: 1} and trainer["spot_bans"] == 1
        assert trainer["spot_checks"] >= steps * ACCUMULATION * 0.25
        events = httpx.get(f"{swarm.url}/api/v1/events", timeout=5).json()
        events = events["events"] if isinstance(events, dict) else events
        assert any(e["kind"] == "ban" and e["peer"] == "liar" and e["stage"] == 1 for e in events), events
    finally:
        swarm.close()
