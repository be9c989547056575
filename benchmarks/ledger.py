"""Which microbatches' gradients reached an applied optimizer step on every stage.

Two sources, both written by the processes themselves: the trainer names the training microbatches
it sent in each step's `--log-json` record (`microbatch_ids`), and every peer started with
`--log-steps` writes one line per optimizer step naming the microbatches that step applied
(benchmarks/common.py `read_step_logs`). A sent microbatch is lost when some stage applied it in
none of its steps (its gradient died with a peer, or was dropped), and applied twice on a stage when
two of that stage's steps hold it (two replicas kept it, or one replica twice).

Ids are opaque: nothing here reads a step or an index out of one. The trainer's last `tail` steps
are left out of "lost": at the end of a run a live peer may still hold their samples in its
accumulator, short of a global batch, or be averaging them when it is stopped.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass


@dataclass(frozen=True)
class Ledger:
    sent: int  # training microbatches the trainer sent in the steps counted (all but the last `tail`)
    missing: dict[int, list[str]]  # stage -> ids sent in those steps that none of its steps applied
    twice: dict[int, list[str]]  # stage -> ids that more than one of its steps applied
    unsettled: dict[int, list[str]]  # stage -> ids of the last `tail` steps not applied (yet)

    @property
    def lost(self) -> int:
        """Microbatches sent whose gradient did not reach an applied step of every stage."""
        return len(set().union(*self.missing.values()))

    @property
    def applied_twice(self) -> int:
        """Microbatches that some stage applied more than once."""
        return len(set().union(*self.twice.values()))

    def summary(self) -> dict[str, str]:
        """The lines a benchmark's summary shows, with the counts of each stage."""

        def per_stage(ids: dict[int, list[str]]) -> str:
            return "; ".join(f"stage {k}: {len(v)}" for k, v in ids.items())

        return {
            "microbatches lost (not applied on every stage)": (
                f"{self.lost} of {self.sent} sent before the last steps ({per_stage(self.missing)})"
            ),
            "applied twice": f"{self.applied_twice} ({per_stage(self.twice)})",
            "not applied (yet) of the last steps": per_stage(self.unsettled),
        }


def sent_ids(records: list[dict]) -> list[list[str]]:
    """The microbatch ids of each of the trainer's `--log-json` records, in order."""
    try:
        return [list(r["microbatch_ids"]) for r in records]
    except KeyError:
        raise ValueError("the trainer's records name no microbatch_ids: a trainer older than this benchmark") from None


def count(records: list[dict], step_logs: list[dict], stages: int, tail: int = 3) -> Ledger:
    """Account for every microbatch the trainer's `records` name against the peers' `step_logs`
    (`{"stage", "step", "microbatches"}` each) of a run of `stages` stages."""
    per_record = sent_ids(records)
    settled_until = max(0, len(per_record) - tail)
    counted = [mb for ids in per_record[:settled_until] for mb in ids]
    recent = [mb for ids in per_record[settled_until:] for mb in ids]
    applied: dict[int, collections.Counter] = {k: collections.Counter() for k in range(stages)}
    for step in step_logs:
        applied[step["stage"]].update(step["microbatches"])
    return Ledger(
        sent=len(counted),
        missing={k: [mb for mb in counted if mb not in c] for k, c in applied.items()},
        twice={k: sorted(mb for mb, n in c.items() if n > 1) for k, c in applied.items()},
        unsettled={k: [mb for mb in recent if mb not in c] for k, c in applied.items()},
    )
