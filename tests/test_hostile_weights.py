"""A hostile insider against the stage's average, with real processes (a coordinator, peers each on a
loopback address of its own, a trainer).

A peer declares 10^6 samples toward every step of its stage, to hivemind's progress tracker and as its
weight in the all-reduce, and hands in no gradient (zeros). hivemind takes both at its word: the
liar's nothing was the stage's whole average (the stage stopped learning), and its report alone
filled every step's batch, so that the honest replica stepped after every microbatch. Now a replica
leaves out reports of more samples than any replica holds and caps every sender's weight by the
trainers' receipts, and the trainer bans a peer whose own signed report makes that claim
(swarm/receipts.py).

Every step and microbatch of the trainer is done, the trainer bans the liar, the honest replica
leaves the liar's reports out of its count (it takes one step per global batch, not one per
microbatch) and caps the liar's weight in the all-reduces it joins: at most twice the global batch,
and one sample once the trainers' receipts leave it out. Without the caps no round capped it (the
liar's zeros then weighed 10^6 against the honest replica's 16 samples); without the impossible
reports left out, the liar was neither banned nor ignored.
"""

from __future__ import annotations

import re

import pytest

from swarm.config import load_config
from swarm.receipts import most_declared
from tests.harness import TINY, Swarm, peer_record
from tests.test_hostile_checks import assert_every_step_done

DECLARED = 10**6
INNER_STEPS = 2
MICRO_BATCH = 2
STEPS = 6


@pytest.mark.parametrize("mode", ["gradients", "diloco"])
def test_a_peer_declaring_a_huge_sample_count_is_banned_and_weighs_little(processes, tmp_path, mode):
    """With DiLoCo the liar declares 10^6 samples for each step of its phase, so its pseudo-gradient
    would weigh 10^6 / inner_steps per step: capped as a gradient's weight is."""
    # Microbatches of 2, 8 a step, so that the liar's reports, were they counted, would have the honest
    # replica step after each of the several microbatches it serves in a step.
    text = TINY.read_text().replace("micro_batch = 8\n", f"micro_batch = {MICRO_BATCH}\n")
    assert f"micro_batch = {MICRO_BATCH}" in text
    if mode == "diloco":
        text += f'\n[averaging]\nmode = "diloco"\ninner_steps = {INNER_STEPS}\n'
    config = tmp_path / "run.toml"
    config.write_text(text)
    weight = DECLARED if mode == "gradients" else DECLARED / INNER_STEPS
    training = load_config(config).training
    swarm = Swarm(tmp_path, config)
    try:
        swarm.add_peer("a", 0)
        swarm.add_peer("liar", 0, "--declare-samples", str(DECLARED))
        swarm.add_peer("b", 1)
        state = swarm.wait_online(["a", "liar", "b"])
        liar = peer_record(state, "liar")["peer_id"]
        swarm.train(STEPS, 4, 20)
        records = assert_every_step_done(swarm, STEPS, training.accumulation)
        out = swarm.trainer.output()
        assert re.search(rf"peer {liar} of stage 0 declared more samples .* banned", out), out[-3000:]
        assert records[-1]["spot_bans"] == 1, records[-1]
        honest = (tmp_path / "a.log").read_text()
        # Its reports left out of the count that decides the honest replica's step: one step per global
        # batch, not one per microbatch.
        assert f"ignoring peer {liar}'s reports of more samples" in honest, honest[-3000:]
        steps = [int(s) for s in re.findall(r"stage 0 step (\d+): \d+ samples", honest)]
        assert 1 <= len(steps) <= STEPS + 1, honest[-3000:]
        # Its weight capped in the honest replica's all-reduces: never more than twice the global batch,
        # and, once banned, the trainer's receipts vouch for none of its samples: one sample.
        caps = re.findall(rf"capped the weight of peer {liar} from {re.escape(f'{weight:g}')} to (\S+) samples", honest)
        assert caps and all(float(c) <= most_declared(training.global_batch) for c in caps), honest[-3000:]
        assert "1" in caps, caps
    finally:
        swarm.close()
