"""A hostile insider against the stage's average, with real processes (a coordinator, peers each on a
loopback address of its own, a trainer).

A peer declares 10^6 samples toward every step of its stage, to hivemind's progress tracker and as its
weight in the all-reduce, and hands in no gradient (zeros). hivemind takes both at its word: the
liar's nothing was the stage's whole average (the stage stopped learning), and its report alone
filled every step's batch, so that the honest replica stepped after every microbatch. Now a replica
leaves out reports of more samples than any replica holds and caps every sender's weight by the
trainers' receipts, and the trainer bans a peer whose own signed report makes that claim
(swarm/receipts.py).

Every step of the trainer completes, the final validation loss is at most 3% above the reference
trainer's, and the liar is banned within a few seconds of its first report.
"""

from __future__ import annotations

import re

import pytest

from tests.test_hostile_checks import STEPS, assert_trained_like_the_reference
from tests.test_swarm import TINY, Swarm, peer_record

DECLARED = 10**6
INNER_STEPS = 2
MICRO_BATCH = 2


@pytest.mark.parametrize("mode", ["gradients", "diloco"])
def test_a_peer_declaring_a_huge_sample_count_is_banned_and_weighs_little(processes, tmp_path, mode):
    """With DiLoCo the liar declares 10^6 samples for each step of its phase, so its pseudo-gradient
    would weigh 10^6 / inner_steps per step: capped as a gradient's weight is."""
    # Microbatches of 2 (8 a step): the liar hands in no gradient, so a step whose every microbatch it
    # served before its ban is lost whatever the weights (no cap helps where it holds all the samples).
    # With the tiny config's 2 microbatches a step that happened in about 1 run of 4 and cost 3% of
    # the final loss; with 8 it takes 8 coin flips in a row.
    text = TINY.read_text().replace("micro_batch = 8\n", f"micro_batch = {MICRO_BATCH}\n")
    assert f"micro_batch = {MICRO_BATCH}" in text
    if mode == "diloco":
        text += f'\n[averaging]\nmode = "diloco"\ninner_steps = {INNER_STEPS}\n'
    config = tmp_path / "run.toml"
    config.write_text(text)
    weight = DECLARED if mode == "gradients" else DECLARED / INNER_STEPS
    swarm = Swarm(tmp_path, config)
    try:
        swarm.add_peer("a", 0)
        swarm.add_peer("liar", 0, "--declare-samples", str(DECLARED))
        swarm.add_peer("b", 1)
        state = swarm.wait_online(["a", "liar", "b"])
        liar = peer_record(state, "liar")["peer_id"]
        swarm.train(STEPS, 4, 20)
        records = assert_trained_like_the_reference(swarm, config)
        assert [r["step"] for r in records] == list(range(STEPS))
        out = swarm.trainer.output()
        assert re.search(rf"peer {liar} of stage 0 declared more samples .* banned", out), out[-3000:]
        assert records[-1]["spot_bans"] >= 1
        honest = (tmp_path / "a.log").read_text()
        # once banned, the trainer's receipts vouch for none of its samples: it weighs one sample
        capped = rf"capped the weight of peer {liar} from {re.escape(f'{weight:g}')} to 1 samples"
        assert re.search(capped, honest), honest[-3000:]
        # the honest replica took one step per global batch, not one per microbatch
        steps = [int(s) for s in re.findall(r"stage 0 step (\d+): \d+ samples", honest)]
        assert len(steps) <= STEPS + 1, honest[-3000:]
    finally:
        swarm.close()
