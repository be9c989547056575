"""A peer's weight in its stage's average: what the trainers saw it serve, not what it claims.

hivemind averages a stage's gradients weighted by the sample count each peer declares, and counts a
stage's progress toward its global batch by the counts the peers report to its progress tracker. Both
are a peer's own word. A peer declaring 10^6 samples would be the whole average (its gradient, be it
the negation of the true one, the step), and its report alone would say every step's batch is full,
so that the honest replicas step after every microbatch.

So:
- **Receipts.** Every trainer counts, per stage and peer, the samples whose gradient it saw a peer
  keep (an inner stage's backward, the last stage's training forward) over its last `WINDOW_STEPS`
  steps, and announces them in its record (`TrainerRecord.served`).
- **Caps.** Before each all-reduce a replica turns the trainers' receipts into a cap per peer of its
  stage (`sample_caps`): `SLACK` times the peer's share of the stage's served samples, times the
  global batch; a peer that served nothing (a liar the trainers banned, or a newcomer the records do
  not show yet) weighs one sample. Every replica reduces its part of the all-reduce with each
  sender's weight capped so (peer/hivemind_compat.py `CappedGradientAverager`). Only the ratio of weights
  matters: a peer alone in its round is its own average whatever its weight.
- **Provable lies.** No honest replica holds more than `most_declared(global_batch)` samples toward
  one step (a batch of work stops at the global batch, its first task taken whatever its size), so
  a progress report above that is a lie: replicas leave it out of the count that decides their step
  (`credible_samples`), and trainers, which read the reports signed by the peers themselves, ban
  the peer (swarm/trainer/membership.py).

Receipts are the trainers' word: a member that joins as a trainer can vouch for a peer. A trainer's
receipts count only while they are possible (at most `most_declared` samples per stage and step of
its window), so such a vouch lifts a peer to at most `SLACK` times the global batch, against the
honest trainers' receipts of everyone else.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Collection, Iterable

WINDOW_STEPS = 16  # a trainer's receipts cover its last this many steps
SLACK = 1.5  # a peer's cap over its share of the served samples: routing moves shares step to step
FLOOR = 1.0  # the weight of a peer the receipts do not show (0 would divide a part of nobody by 0)


def most_declared(global_batch: int) -> int:
    """More samples than any honest replica holds toward one step: twice the global batch."""
    return 2 * global_batch


class Receipts:
    """A trainer's count of the samples each peer kept gradients of, per stage, over its last
    `window` steps; thread-safe (the microbatches' threads add, the membership's refresh reads)."""

    def __init__(self, window: int = WINDOW_STEPS):
        self.steps: collections.deque[collections.Counter] = collections.deque([collections.Counter()], maxlen=window)
        self.lock = threading.Lock()

    def add(self, stage: int, peer: str, samples: int) -> None:
        with self.lock:
            self.steps[-1][(stage, peer)] += samples

    def next_step(self) -> None:
        with self.lock:
            self.steps.append(collections.Counter())

    def recent(self) -> dict[str, dict[str, int]]:
        """stage (as text, a JSON key) -> peer -> samples over the window."""
        out: dict[str, dict[str, int]] = collections.defaultdict(dict)
        with self.lock:
            for counts in self.steps:
                for (stage, peer), n in counts.items():
                    out[str(stage)][peer] = out[str(stage)].get(peer, 0) + n
        return dict(out)


def sample_caps(
    receipts: Iterable[dict[str, int]], members: Collection[str], global_batch: int
) -> dict[str, float] | None:
    """The most each of a stage's `members` (peer ids) may weigh in its all-reduce, from the trainers'
    `receipts` for the stage (each trainer's: peer -> samples over its window); None when no trainer
    reported a sample (nothing to go by: weights stay as declared, up to `most_declared`). A trainer's
    receipts beyond what its window could hold are left out."""
    most = most_declared(global_batch)
    served: collections.Counter = collections.Counter()
    for counts in receipts:
        if sum(counts.values()) <= WINDOW_STEPS * most:
            served.update({p: n for p, n in counts.items() if p in members})
    total = sum(served.values())
    if total == 0:
        return None
    return {p: max(FLOOR, min(most, SLACK * global_batch * served[p] / total)) for p in members}


def capped_weight(caps: dict[str, float] | None, peer: str, declared: float, global_batch: int) -> float:
    """A sender's weight in a replica's part of the all-reduce: its `declared` weight, capped."""
    cap = most_declared(global_batch) if caps is None else caps.get(peer, FLOOR)
    return min(declared, cap)


def impossible(reports: Iterable[tuple[str, int, int]], global_batch: int) -> list[str]:
    """The peers of the progress `reports` (peer, epoch, samples) that claim more than `most_declared`."""
    return [peer for peer, _, samples in reports if samples > most_declared(global_batch)]


def credible_samples(reports: Iterable[tuple[str, int, int]], epoch: int, global_batch: int) -> tuple[int, list[str]]:
    """The samples a stage's replicas hold toward step `epoch`, from their progress `reports` (peer,
    epoch, samples), leaving out the `impossible` ones; and those reports' peers."""
    reports = list(reports)
    liars = impossible(reports, global_batch)
    total = sum(samples for peer, at, samples in reports if at == epoch and peer not in liars)
    return total, liars
