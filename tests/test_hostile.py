"""Hostile insiders: peers that hold the run's join token and answer with tensors the trainer cannot
use. Real processes: a coordinator, peers (two started with the test-only `--malformed` flag), a
trainer. The trainer checks every answer before it uses it (swarm/trainer/loop.py): a bad one is
blamed on the peer that gave it, the hop is redone on another peer of the stage, and after
`verify.strikes` bad answers the peer is banned; the run completes every step."""

from __future__ import annotations

import re

from tests.conftest import run_cli
from tests.processes import start_peer, wait_for_state
from tests.test_swarm import ACCUMULATION, TINY, Swarm, peer_record

# Long enough for the hostile peer's second strike: after its first bad answer it gets no backward, falls
# behind its stage, and refuses work (and is banned again) until the records show the stage's step and it
# loads the stage's state; a run of 8 steps (3 s) once ended before it was asked again.
STEPS = 10  # both hostile peers are banned within the first steps (their strikes come first)
STRIKES = 2  # tiny.toml leaves verify.strikes at its default


def test_peers_answering_malformed_tensors_are_banned_and_every_step_completes(processes, tmp_path):
    """Two hostile peers of stage 0, one answering tensors of the wrong shape, one answering NaN: each
    bad answer is blamed on the peer that gave it (never on an honest one) and redone elsewhere, each
    hostile peer is banned after its strikes, and the run completes every step."""
    swarm = Swarm(tmp_path)
    try:
        # The honest peer of stage 0 is slower, so that the router sends the hostile ones calls: each
        # peer's speed is measured as it starts, and on a loaded machine an honest peer that measured
        # faster took every call of 20 steps (the router sends a call where it expects it done first).
        swarm.add_peer("honest0", 0, "--delay-per-sample", "0.01")
        for malformed in ("shape", "nan"):
            swarm.add_peer(malformed, 0, "--malformed", malformed)
        swarm.add_peer("honest1", 1)
        state = swarm.wait_online(["honest0", "shape", "nan", "honest1"])
        hostile = {name: peer_record(state, name)["peer_id"] for name in ("shape", "nan")}
        swarm.train(STEPS, 4, 20, "--verify-fraction", "0")  # no spot checks: the answer checks alone
        records = swarm.finish_training()
        out = swarm.trainer.output()
        assert len(records) == STEPS and records[-1]["microbatches"] == STEPS * ACCUMULATION, out[-3000:]
        assert records[-1]["loss"] < records[0]["loss"]
        for name, why in (("shape", "shape"), ("nan", "contains NaN or Inf")):
            blamed = re.findall(rf"stage 0 peer (\S+) failed \(bad answer: output: [^)]*{why}", out)
            assert blamed and set(blamed) == {hostile[name][-8:]}, out[-3000:]  # the honest peers never
            assert f"bad answers: banned peer {hostile[name]} of stage 0" in out, out[-3000:]
        # Banned after their strikes: the calls already in flight to one (at most --inflight) can add to them.
        assert 2 * STRIKES <= records[-1]["bad_answers"] <= 2 * (STRIKES + 4), records[-1]
        s = wait_for_state(
            swarm.url, lambda s: any(len(t.get("spot_banned", {})) == 2 for t in s["trainers"]), timeout=15
        )
        assert s["trainers"][0]["spot_banned"] == {peer: 0 for peer in hostile.values()}
    finally:
        swarm.close()


def test_with_no_other_worker_to_ask_a_bad_answer_ends_the_run_with_one_line(processes, tmp_path):
    """A static pipeline (`--peers`) has one worker per stage: a bad answer cannot be asked of
    another, and the run ends with one line naming the worker and what was wrong, no traceback."""
    procs = []
    try:
        for k, extra in enumerate([("--malformed", "shape"), ()]):
            proc, address = start_peer(TINY, k, tmp_path, *extra)
            procs.append((proc, address))
        peers = ",".join(address for _, address in procs)
        result = run_cli("train", "--config", str(TINY), "--peers", peers, "--steps", "1")
        assert result.returncode == 1, result.stderr[-3000:]
        assert f"error: stage 0 worker {procs[0][1]} gave a bad answer: output: shape [8, 127, 128]" in result.stderr
        assert "Traceback" not in result.stderr
    finally:
        for proc, _ in procs:
            proc.stop()
