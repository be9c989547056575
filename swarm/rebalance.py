"""Should a peer move to another stage? A pure function of the peers' announced capacities.

Every peer computes the same best assignment of peers to stages from the same DHT view (the one
that maximises the stage totals from the lowest up, moving as few peers as possible), and moves
to its stage there only when that assignment lifts the swarm's lowest stage total (the pipeline's
throughput) above today's by a clear margin (hysteresis, so that peers do not thrash) and its
leaving does not empty its stage. Moving one peer at a time toward a common target reaches
assignments that single greedy moves cannot (a swap of two peers, say): from all peers on one
stage, a simulation over random speeds ends within 10% of the brute-force optimum, where greedy
single moves stop as low as 0.68 of it. Peers check at randomised times, so two peers rarely act
on the same picture at once.

A peer acts only on a picture it can trust (`Steadiness`): every record fresh, and the swarm's
membership unchanged for a while. A peer that dies leaves its record in the DHT until it expires;
acted on, that record makes a survivor leave the stage the dead peer no longer serves (a 2 x 2
swarm that lost one peer moved peers back and forth and stalled the trainer for minutes). Peers
are weighed by their capacity, the throughput their device measured on a benchmark (the same for
every stage up to the stage's compute per token), not by the speed they served at lately, which
moves with the load of the moment (after a failure, the survivors' queues).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

from swarm.config import RebalanceConfig
from swarm.records import REFRESH_S, PeerRecord, SwarmView

MARGIN = RebalanceConfig().margin  # the run config's default `rebalance.margin`
MIN_LIFT = 0.01  # the least a planned move lifts the lowest stage by, as a fraction of its total (large swarms)
# A peer that moves with make-before-break announces when it will serve its target (PeerRecord.ready_at;
# the trainers route to it there from then on: SwarmView.routable): its last load of a stage, then
# SWITCH_S for the switch (the old stage's calls drain, the new server starts). Not padded: an early
# announcement costs a failed call or two, retried elsewhere; a late one leaves the peer idle on its
# target (padded by a quarter and 3 s, the simulated swarm gained a third as much, benchmarks/simulate.py).
SWITCH_S = 2.0


def expected_move_s(last_load_s: float, scale: float = 1.0) -> float:
    """Seconds a make-before-break move should take, to announce: `last_load_s`, the peer's last load of
    a stage, times `scale`, the target stage's size over that stage's; then the switch."""
    return last_load_s * scale + SWITCH_S


def best_assignment(throughputs: list[float], current: list[int], num_stages: int) -> list[int]:
    """The stage of each peer that maximises the stage totals (leximin), moving as few peers as
    possible from `current` among equally good ones. Exhaustive for small swarms; for large ones,
    `current` improved one move at a time (`_lift_lowest`)."""
    n = len(throughputs)

    def key(assign: tuple[int, ...]) -> tuple:
        totals = [0.0] * num_stages
        for x, k in zip(throughputs, assign, strict=True):
            totals[k] += x
        # Round so that float noise does not break ties; then fewer moves, then a fixed order.
        return tuple(round(t, 6) for t in sorted(totals)), -sum(a != c for a, c in zip(assign, current, strict=True))

    if num_stages**n <= 50_000:
        return list(max(itertools.product(range(num_stages), repeat=n), key=lambda a: (key(a), tuple(-x for x in a))))
    return _lift_lowest(throughputs, current, num_stages)


def _lift_lowest(throughputs: list[float], current: list[int], num_stages: int) -> list[int]:
    """`current`, with peers moved one at a time to the lowest stage, each time the one move that lifts
    it most, until no move lifts it by `MIN_LIFT` of its total (smaller gains are not worth a peer's
    download, and chasing them moved 23 stragglers of a 160-peer swarm about for 2%). A plan made
    from scratch instead (each peer, fastest first, to the stage with the lowest total) differs from
    `current` for most peers of a swarm that churn has put slightly off balance, and every peer that
    checks moves: in a simulation of 100 peers on 8 stages with churn (benchmarks/simulate.py, the
    rows of results.md), 17 moves per peer-hour and the pipeline at 0.58 of the oracle, against 0.59
    and 0.84 with this."""
    assign = list(current)
    totals = [0.0] * num_stages
    for x, k in zip(throughputs, assign, strict=True):
        totals[k] += x
    for _ in range(len(assign)):
        low = min(range(num_stages), key=lambda k: (totals[k], k))
        best, lifted = None, totals[low]
        floor = MIN_LIFT * lifted
        for i, (x, k) in enumerate(zip(throughputs, assign, strict=True)):
            if k != low and x > 0 and (then := min(totals[k] - x, totals[low] + x)) > lifted + floor:
                best, lifted = i, then
        if best is None:
            break
        x = throughputs[best]
        totals[assign[best]] -= x
        totals[low] += x
        assign[best] = low
    return assign


def move_for(
    throughputs: list[float], current: list[int], me: int, num_stages: int, margin: float = MARGIN
) -> int | None:
    """Where peer `me` should go (`moves`); None: stay."""
    return moves(throughputs, current, num_stages, margin)[me]


def moves(throughputs: list[float], current: list[int], num_stages: int, margin: float = MARGIN) -> list[int | None]:
    """Where each peer should go: its stage in the best assignment, when that assignment lifts the
    lowest stage total above today's by more than `margin` and its leaving does not empty its stage;
    else None (stay). A move that leaves the lowest stage where it is (it would only lift others)
    is never worth its cost: the new stage's state crosses the peer's link, and a peer without room
    for both stages stops serving while it downloads it (peer/daemon.py `PeerDaemon.move`). One
    plan for all: every peer that reads the same view computes the same (and a caller that decides
    for many peers at once computes it once)."""
    stay: list[int | None] = [None] * len(current)
    if not current:
        return stay
    target = best_assignment(throughputs, current, num_stages)

    def lowest(assign: list[int]) -> float:
        out = [0.0] * num_stages
        for x, k in zip(throughputs, assign, strict=True):
            out[k] += x
        return min(out)

    now, then = lowest(current), lowest(target)
    if not (then > now * (1 + effective_margin(margin, len(current), num_stages)) and then > 0):
        return stay
    counts = [0] * num_stages
    for k in current:
        counts[k] += 1
    return [
        t if t != c and x > 0 and counts[c] > 1 else None for x, c, t in zip(throughputs, current, target, strict=True)
    ]


def effective_margin(margin: float, peers: int, num_stages: int) -> float:
    """The lift a plan must bring: `margin`, or half an average peer's share of a stage when that is
    less. The margin keeps a few peers from moving on noise in their capacities (three peers on one
    machine measured 74 to 117 samples/s); but in stages of many peers one departure takes less than
    the margin, and nobody would move to make up for it until a newcomer joined that stage. In a
    simulation of 100 peers on 8 stages with churn (benchmarks/simulate.py), 0.885 of the oracle with
    the margin alone, 0.89-0.90 with this. One peer mismeasured by half moves its stage's total by
    less than the scaled margin."""
    per_stage = peers / num_stages if num_stages else 0
    return margin if per_stage <= 0 else min(margin, 1 / (2 * per_stage))


def placements(view: SwarmView) -> list[tuple[str, int, float]]:
    """(peer id, stage, throughput) of every peer that serves or is about to: the online ones, and
    those in the middle of a move, counted on the stage they are moving to (online with `moving_to`
    while they serve their stage and load the next, or leaving with it when they stop first; then
    joining or online there). Without the movers, a peer checking during someone's move sees the
    target stage still short and moves as well."""
    best: dict[str, tuple[int, int, float]] = {}  # peer id -> (rank, stage, capacity)
    stages = len(view.stages)
    for records in view.stages:
        for p in records:
            if p.state == "online":
                rank, stage = 0, p.stage if p.moving_to is None or p.moving_to >= stages else p.moving_to
            elif p.state == "joining" and capacity(p) > 0:
                rank, stage = 1, p.stage
            elif p.state == "leaving" and p.moving_to is not None and p.moving_to < stages:
                rank, stage = 2, p.moving_to
            else:
                continue
            if p.peer_id not in best or rank < best[p.peer_id][0]:
                best[p.peer_id] = (rank, stage, capacity(p))
    return sorted(((pid, stage, x) for pid, (_, stage, x) in best.items()), key=lambda t: (t[1], t[0]))


def stage_totals(view: SwarmView) -> list[float]:
    """Each stage's summed capacity, counting the peers about to serve it (`placements`): where a joining
    peer should go (swarm/placement.py `pick_stage`). Counted by the online peers alone, every peer that
    joins while another downloads a stage picks the same stage (a join every 36 s and downloads of up
    to 80 s, in a simulation of 100 peers with one-hour sessions)."""
    totals = [0.0] * len(view.stages)
    for _, stage, x in placements(view):
        totals[stage] += x
    return totals


def capacity(p: PeerRecord) -> float:
    """What a move decision weighs a peer by: its measured capacity (older peers announce none: their
    throughput)."""
    return p.capacity if p.capacity > 0 else p.throughput


# The share of a large swarm's records that may have changed within `settle_s`, or be stale, with the
# swarm still steady enough to act on. In a public swarm peers come and go every few seconds: at 1,000
# peers with one-hour sessions the membership never holds still for 12 s, and a steadiness that waits
# for it lets nobody move, ever (benchmarks/simulate.py). Below 1 / CHURN_TOLERANCE peers nothing
# may change: a 2 x 2 swarm that lost one peer waits for the dead peer's record to expire and the
# membership to hold still, as it must.
CHURN_TOLERANCE = 0.02


@dataclass
class Steadiness:
    """Whether the swarm's picture can be acted on: no record older than `max_age_s` (a peer that died
    leaves a record that stops being refreshed, while the others' are), and the membership (who is on
    which stage, in which state) unchanged for `settle_s` (a change, e.g. a record that expired, shows
    the swarm is still moving); in a large swarm, up to `tolerance` of its records may be stale or have changed (the
    churn of the moment, not a swarm on the move). Fed every view a peer reads, with the DHT time it
    was read at; no clock of its own."""

    settle_s: float
    max_age_s: float
    tolerance: float = 0.0
    members: dict[str, tuple] = field(default_factory=dict)
    changes: deque[tuple[float, int]] = field(default_factory=deque)  # (when, how many records changed)

    def observe(self, view: SwarmView, now: float) -> bool:
        """Take in `view`, read at `now` (DHT time); True when it is steady enough to act on."""
        records = [p for stage in view.stages for p in stage]
        members = {p.peer_id: (p.stage, p.state, p.moving_to) for p in records}
        changed = sum(1 for pid, m in members.items() if self.members.get(pid) != m)
        changed += sum(1 for pid in self.members if pid not in members)
        if changed:  # at first sight, every record is a change: nothing has held still yet
            self.changes.append((now, changed))
        self.members = members
        while self.changes and now - self.changes[0][0] >= self.settle_s:
            self.changes.popleft()
        allowed = int(self.tolerance * len(records))
        # Ages are taken from the newest record when the whole view is late (a DHT whose records
        # arrive seconds after they were written): a dead peer's record is old beside the others,
        # and a view late as a whole is not a swarm of dead peers (peers that read the DHT 12 s late
        # never acted, and the peers a plan picked to move never moved).
        newest = min(now, max((p.updated for p in records), default=now))
        stale = sum(1 for p in records if newest - p.updated > self.max_age_s)
        return stale <= allowed and sum(n for _, n in self.changes) <= allowed


SETTLE_S = REFRESH_S  # how long the membership must hold still before a peer acts on it (`peer_steadiness`)


def peer_steadiness(settle_s: float = SETTLE_S) -> Steadiness:
    """The steadiness a peer checks before it moves: a record not refreshed for two periods is likely a
    dead peer's, and holds every move back until it expires; the membership must then hold still for
    one refresh period, in which every live peer re-announces itself, so that the view shows each
    one's latest state. (Holding still for a record's whole time to live as well cost 12 s more on
    every departure, a third of the time a swarm took to answer one: 0.897 of the oracle against
    0.903, over 24 seeds of a simulated 100-peer swarm, benchmarks/simulate.py.)"""
    return Steadiness(settle_s=settle_s, max_age_s=2 * REFRESH_S, tolerance=CHURN_TOLERANCE)


def planned_moves(view: SwarmView, margin: float = MARGIN) -> dict[str, int]:
    """`moves` on what the DHT says: the peers that serve or are moving (`placements`), each with its
    announced capacity; peer id -> the stage it should move to, for the online peers that should."""
    peers = placements(view)
    targets = moves([x for _, _, x in peers], [k for _, k, _ in peers], len(view.stages), margin)
    return {pid: t for (pid, _, _), t in zip(peers, targets, strict=True) if t is not None}


def should_move(
    view: SwarmView,
    me: PeerRecord,
    margin: float = MARGIN,
    allowed: Collection[int] | None = None,
    plan: dict[str, int] | None = None,
) -> int | None:
    """This peer's move in `planned_moves` (or in `plan`, that view's, when the caller made it). A target
    outside `allowed` (the stages this peer's device can hold; None: all) is no move: the peer stays."""
    if not any(p.peer_id == me.peer_id and p.state == "online" for p in view.online(me.stage)):
        return None  # not online where we think we are: wait for the next refresh
    if me.moving_to is not None:
        return None  # moving already
    target = (planned_moves(view, margin) if plan is None else plan).get(me.peer_id)
    return target if target is None or allowed is None or target in allowed else None
