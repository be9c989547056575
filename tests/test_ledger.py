"""The microbatch ledger of the benchmarks (benchmarks/ledger.py): the ids a trainer sent against the
microbatches the stages' optimizer steps applied. Pure: records and step logs as the processes write
them."""

from __future__ import annotations

import pytest

from benchmarks.ledger import count


def record(*ids: str) -> dict:
    return {"step": 0, "loss": 1.0, "microbatch_ids": list(ids)}


def applied(stage: int, step: int, *ids: str) -> dict:
    return {"stage": stage, "step": step, "microbatches": list(ids), "peer": f"p{stage}"}


RECORDS = [record("x1", "x2"), record("y1", "y2"), record("z1", "z2")]
EVERYTHING = [applied(k, s, *ids) for k in (0, 1) for s, ids in enumerate([("x1", "x2"), ("y1", "y2"), ("z1", "z2")])]


def test_every_microbatch_applied_once_on_every_stage_is_neither_lost_nor_twice():
    ledger = count(RECORDS, EVERYTHING, stages=2, tail=1)
    assert (ledger.sent, ledger.lost, ledger.applied_twice) == (4, 0, 0)
    assert ledger.unsettled == {0: [], 1: []}


def test_a_microbatch_missing_from_one_stage_is_lost_once_however_many_stages_miss_it():
    # y2 died with a peer of stage 1; x1 with peers of both stages: one microbatch lost, not two.
    logs = [s for s in EVERYTHING if s["stage"] == 0 or s["step"] != 1] + [applied(1, 1, "y1")]
    logs = [dict(s, microbatches=[m for m in s["microbatches"] if m != "x1"]) for s in logs]
    ledger = count(RECORDS, logs, stages=2, tail=1)
    assert ledger.missing == {0: ["x1"], 1: ["x1", "y2"]}
    assert ledger.lost == 2 and ledger.applied_twice == 0


def test_a_microbatch_two_steps_of_a_stage_applied_counts_twice():
    # A replica kept x2 after its caller had retried it on the other replica.
    logs = [*EVERYTHING, applied(1, 2, "x2")]
    ledger = count(RECORDS, logs, stages=2, tail=1)
    assert ledger.twice == {0: [], 1: ["x2"]} and ledger.applied_twice == 1 and ledger.lost == 0


def test_the_last_steps_are_not_lost_while_a_live_peer_may_still_hold_them():
    logs = [s for s in EVERYTHING if s["step"] < 2]  # step 2 is still in an accumulator
    assert count(RECORDS, logs, stages=2, tail=1).lost == 0
    ledger = count(RECORDS, logs, stages=2, tail=0)
    assert ledger.lost == 2 and ledger.unsettled == {0: [], 1: []}
    assert count(RECORDS, logs, stages=2, tail=1).unsettled == {0: ["z1", "z2"], 1: ["z1", "z2"]}


def test_a_stage_with_no_step_log_at_all_lost_everything():
    ledger = count(RECORDS, [s for s in EVERYTHING if s["stage"] == 0], stages=2, tail=0)
    assert ledger.lost == 6 and ledger.missing[0] == []


def test_records_without_ids_are_refused_by_name():
    with pytest.raises(ValueError, match="microbatch_ids"):
        count([{"step": 0, "loss": 1.0}], [], stages=2)
