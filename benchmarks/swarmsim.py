"""A time-stepped simulation of a swarm at internet scale, decided by the project's own policies.

Peers (devices of different speeds, home links), trainers and the DHT are simulated; every decision
is made by the code the real peers and trainers run, imported: a joining peer's stage by
`swarm.placement.pick_stage`, a peer's move by `swarm.rebalance.should_move` behind a
`swarm.rebalance.Steadiness` (checked at randomised periods, as peer/daemon.py does), and the
trainer's split of each stage's work by one `swarm.routing.Router` per stage.

Time advances in steps of `REFRESH_S` (every peer re-announces its record once a step). The DHT
delay: each peer and the trainer read the swarm as it was 0, 4, 8 or 12 s ago (its delay class, drawn
at join), records stamped when they were written, so a late reader sees old records as old.

A stage's state (`stage_gb`) downloads at the peer's own downlink, a quarter faster or slower from one
download to the next. A peer that moves keeps serving its stage meanwhile (make-before-break, as
peer/daemon.py does) and announces when it will serve the target: its last download's time, as the
real peer computes it (`swarm.rebalance.expected_move_s`); the trainer routes to it there from that
time on (`swarm.records.SwarmView.routable`), a failed call whenever it was early.

Routing is a flow, not microbatch by microbatch (1,000 peers for 2 hours would be ~10^8 calls): each
step the trainer's router of every stage is given the peers it reads in the DHT (`update_peers`), and
in steady state its earliest-finish rule splits the work in proportion to the throughput it plans
with (`stats`). A stage then serves at most the sum of its live peers' speeds, and no faster than its
most over-planned peer allows; calls that went to a peer that is gone fail (`failed`: banned with
back-off, a retried share), the others report the speed the peer served at (`done`).

The oracle at each step: the best pipeline throughput the peers present could give (those that have
served since they joined: a newcomer's first download is no policy's doing), each at its effective
speed (compute and link), on the best assignment: `swarm.rebalance.best_assignment` exhaustively for
small swarms, else the bound sum / stages (no assignment does better).

A fourth policy, `clairvoyant`, is a ceiling rather than a design: it sees each departure the moment
it happens (no DHT delay, no record to expire) and answers it at once with a make-before-break move
(a peer of the stage with the most throughput downloads the emptied stage while it goes on serving
its own), and does nothing else. What it leaves on the table is what any policy that must download a
stage before serving it leaves: the emptied stage is short for one download.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from peer.throughput import capacity
from swarm.config import RebalanceConfig
from swarm.placement import pick_stage
from swarm.rebalance import (
    SETTLE_S,
    best_assignment,
    expected_move_s,
    peer_steadiness,
    planned_moves,
    should_move,
    stage_totals,
)
from swarm.records import REFRESH_S, TTL_S, PeerRecord, SwarmView
from swarm.routing import Router

DELAY_CLASSES = 4  # read delays 0, 4, 8, 12 s
MICROBATCH = 8  # samples per call, for the per-call latency
DOWNLOAD_JITTER = 0.25  # a download takes up to this fraction more or less than the peer's downlink gives


@dataclass(frozen=True)
class Device:
    name: str
    speed: float  # samples/s of one stage's forward + backward
    share: float  # fraction of the peers


@dataclass(frozen=True)
class SimOptions:
    peers: int = 100
    stages: int = 8
    minutes: float = 120.0
    devices: tuple[Device, ...] = ()
    uplink_mbit: tuple[float, float] = (10.0, 50.0)
    downlink_mbit: tuple[float, float] = (50.0, 300.0)
    latency_ms: tuple[float, float] = (10.0, 150.0)
    activation_mb: float = 0.25  # MB of activations (or gradients) per sample and hop
    stage_gb: float = 0.5  # a stage's weights and optimizer state, downloaded at join and at a move
    session_min: float = 60.0  # mean session length (exponential); joins keep the mean population
    mass_leave_at_min: float | None = 60.0  # when a fraction of the peers leaves at once (None: never)
    mass_leave_fraction: float = 0.2
    mass_leave_stages: int = 0  # the peers that leave at once come from this many stages (0: from all)
    policy: str = "swarm"  # swarm | petals | static | clairvoyant
    period_s: float = RebalanceConfig().period_s
    margin: float = RebalanceConfig().margin
    settle_s: float = SETTLE_S  # how long a peer's view must hold still before it acts (swarm/rebalance.py)
    petals_period_s: float = 60.0
    petals_quality: float = 0.75
    seed: int = 0
    link_in_capacity: bool = True  # peers announce the lower of compute and link (peer/throughput.py `capacity`)
    # movers announce when they will serve their target, and the trainer routes to them there from then
    # on (swarm/records.py `SwarmView.routable`); without it, once their new record reaches the trainer
    announce_ready: bool = True


DEFAULT_DEVICES = (
    Device("T4", 1.0, 0.25),
    Device("3090", 2.2, 0.3),
    Device("4090", 3.5, 0.2),
    Device("A100", 5.0, 0.1),
    Device("CPU", 0.05, 0.15),
)


@dataclass
class SimPeer:
    peer_id: str
    device: Device
    effective: float  # samples/s it can serve: compute, link and latency together
    capacity: float  # samples/s it announces: compute and link (peer/throughput.py `capacity`)
    delay_class: int
    downlink_mbit: float
    stage: int = 0
    state: str = "joining"  # joining | online | leaving
    moving_to: int | None = None  # while moving: online still serving `stage`, or leaving (petals)
    ready_at: float = 0.0  # when the current download (join or move) ends
    load_s: float = 0.0  # how long its last download (join or move) took
    announced_ready: float | None = None  # while moving: when it announced it would serve the target
    next_check: float = 0.0
    started: float = 0.0
    serving: bool = False  # has served since it joined: from then on, a move's download counts against the policy


@dataclass
class SimResult:
    times: list[float] = field(default_factory=list)
    achieved: list[float] = field(default_factory=list)
    oracle: list[float] = field(default_factory=list)
    moves: int = 0
    peer_seconds: float = 0.0
    microbatches: float = 0.0
    retried: float = 0.0
    dht_messages: float = 0.0
    node_seconds: float = 0.0
    recovery_s: float | None = None
    mass_leave_at: float | None = None

    @property
    def ratio(self) -> float:
        """Achieved throughput ÷ oracle, averaged over time (steps with no oracle skipped)."""
        pairs = [a / o for a, o in zip(self.achieved, self.oracle, strict=True) if o > 0]
        return sum(pairs) / len(pairs) if pairs else 0.0

    def ratio_series(self) -> list[tuple[float, float]]:
        return [(t, a / o) for t, a, o in zip(self.times, self.achieved, self.oracle, strict=True) if o > 0]


def effective_speed(capacity: float, latency_s: float) -> float:
    """Samples/s a peer serves: its compute and link (`capacity`, peer/throughput.py) and a round trip
    per microbatch."""
    return MICROBATCH / (MICROBATCH / capacity + latency_s)


def oracle(speeds_by_peer: list[float], stages: int) -> float:
    """The best pipeline throughput of these peers: exact for small swarms, else the bound sum / stages."""
    if not speeds_by_peer:
        return 0.0
    if stages ** len(speeds_by_peer) <= 50_000:
        assign = best_assignment(speeds_by_peer, [0] * len(speeds_by_peer), stages)
        totals = [0.0] * stages
        for x, k in zip(speeds_by_peer, assign, strict=True):
            totals[k] += x
        return min(totals)
    return sum(speeds_by_peer) / stages


class SimDHT:
    """The DHT as the simulated peers and the trainer read it: each live peer's record as last written,
    the departed peers' records until they expire, and the swarm as it was at each of the last
    DELAY_CLASSES steps (a reader of delay class c sees it as it was c steps ago)."""

    def __init__(self, options: SimOptions) -> None:
        self.o = options
        self.history: deque[SwarmView] = deque(maxlen=DELAY_CLASSES)
        self.records: dict[str, PeerRecord] = {}  # each live peer's record as last written
        self.ghosts: dict[str, PeerRecord] = {}  # departed peers' last records, in the DHT until they expire

    def forget(self, pid: str) -> None:
        """A peer left without a word (closed laptop, lost link): its record stays until it expires."""
        if pid in self.records:
            self.ghosts[pid] = self.records.pop(pid)

    def publish(self, peers: Iterable[SimPeer], now: float) -> None:
        """Every peer's record as written this step (one store per peer), and the departed peers' records
        that have not expired yet."""
        stages: list[list[PeerRecord]] = [[] for _ in range(self.o.stages)]
        self.ghosts = {pid: g for pid, g in self.ghosts.items() if now - g.updated < TTL_S}
        for g in self.ghosts.values():
            stages[g.stage].append(g)
        for p in peers:
            stages[p.stage].append(
                record := PeerRecord(  # validated: faster than pydantic's model_construct (130 us against 2)
                    peer_id=p.peer_id,
                    address="",
                    stage=p.stage,
                    state=p.state,
                    moving_to=p.moving_to,
                    ready_at=p.announced_ready if p.moving_to is not None and self.o.announce_ready else None,
                    throughput=self.announced(p) if p.state == "online" else 0.0,
                    capacity=self.announced(p),
                    updated=now,
                )
            )
            self.records[p.peer_id] = record
        self.history.appendleft(SwarmView.model_construct(stages=stages, trainers=[], read_at=now))

    def announced(self, p: SimPeer) -> float:
        """What a peer announces it can do: the lower of its device's benchmark and its link's speed test
        (peer/throughput.py `capacity`); without `link_in_capacity`, the benchmark alone."""
        return p.capacity if self.o.link_in_capacity else p.device.speed

    def view(self, delay_class: int) -> SwarmView:
        return self.history[min(delay_class, len(self.history) - 1)]


class Simulation:
    def __init__(self, options: SimOptions) -> None:
        self.o = options
        self.rng = random.Random(options.seed)
        self.devices = options.devices or DEFAULT_DEVICES
        self.peers: dict[str, SimPeer] = {}
        self.departures: list[tuple[float, str]] = []  # heap of (time, peer id)
        self.counter = 0
        self.now = 0.0
        # Peers of one delay class read the same views at the same steps, so they share one Steadiness.
        self.steadiness = [peer_steadiness(options.settle_s) for _ in range(DELAY_CLASSES)]
        self.dht = SimDHT(options)
        self.routers = [Router() for _ in range(options.stages)]
        self.result = SimResult()

    # -- peers -------------------------------------------------------------------------------------

    def new_peer(self) -> SimPeer:
        r = self.rng
        device = r.choices(self.devices, weights=[d.share for d in self.devices])[0]
        up, down = r.uniform(*self.o.uplink_mbit), r.uniform(*self.o.downlink_mbit)
        announced = capacity(device.speed, up * 1e6, down * 1e6, self.o.activation_mb * 1e6, self.o.activation_mb * 1e6)
        speed = effective_speed(announced, r.uniform(*self.o.latency_ms) / 1000)
        self.counter += 1
        peer = SimPeer(
            f"p{self.counter:05d}", device, speed, announced, r.randrange(DELAY_CLASSES), down, started=self.now
        )
        period = self.o.petals_period_s if self.o.policy == "petals" else self.o.period_s
        peer.next_check = self.now + r.uniform(0.5, 1.5) * period
        heapq.heappush(self.departures, (self.now + r.expovariate(1 / (self.o.session_min * 60)), peer.peer_id))
        return peer

    def download_s(self, peer: SimPeer) -> float:
        """A stage's download at the peer's downlink, which varies by up to DOWNLOAD_JITTER either way
        from one download to the next (the link is shared, the sending peers differ)."""
        jitter = self.rng.uniform(1 - DOWNLOAD_JITTER, 1 + DOWNLOAD_JITTER)
        return self.o.stage_gb * 8000 / peer.downlink_mbit * jitter

    def join(self, peer: SimPeer, stage: int | None = None) -> None:
        if stage is None:
            view = self.view(peer.delay_class)
            counts = [len(s) for s in view.stages]
            stage = pick_stage(stage_totals(view), counts)
        peer.load_s = self.download_s(peer)
        peer.stage, peer.state, peer.ready_at = stage, "joining", self.now + peer.load_s
        self.peers[peer.peer_id] = peer

    def depart(self, pid: str) -> None:
        """A peer leaves without a word (closed laptop, lost link): its record stays until it expires."""
        peer = self.peers.pop(pid, None)
        if peer is not None:
            self.dht.forget(pid)
        if peer is not None and self.o.policy == "clairvoyant" and peer.state == "online":
            self.respond(peer)

    def move(self, peer: SimPeer, target: int) -> None:
        # The mover keeps serving its stage while it downloads the next, as a real peer with room for both
        # stages does (peer/daemon.py `PeerDaemon.move`); a Petals-style server restarts on its new blocks.
        keeps_serving = self.o.policy != "petals"
        peer.state = "online" if keeps_serving else "leaving"
        # What the real peer announces (peer/daemon.py): from its last download, not from this one's.
        peer.announced_ready = self.now + expected_move_s(peer.load_s) if keeps_serving else None
        peer.load_s = 2.0 + self.download_s(peer)
        peer.moving_to, peer.ready_at = target, self.now + peer.load_s
        self.result.moves += 1

    def respond(self, gone: SimPeer) -> None:
        """clairvoyant: answer a departure at once, from the truth: the peer of the stage with the most
        throughput (counting movers where they go) whose speed is closest to the departed peer's moves
        to the stage it left, when that lifts the lower of the two."""
        totals = [0.0] * self.o.stages
        for p in self.peers.values():
            if p.state == "online":
                totals[p.stage if p.moving_to is None else p.moving_to] += p.effective
        hole = gone.stage if gone.moving_to is None else gone.moving_to
        rich = max((k for k in range(self.o.stages) if k != hole), key=lambda k: totals[k], default=None)
        candidates = [p for p in self.peers.values() if p.state == "online" and p.moving_to is None and p.stage == rich]
        if not candidates:
            return
        peer = min(candidates, key=lambda p: abs(p.effective - gone.effective))
        if totals[rich] - peer.effective > totals[hole]:
            self.move(peer, hole)

    # -- the DHT -----------------------------------------------------------------------------------

    def publish(self) -> None:
        """Every peer's record as written this step (`SimDHT.publish`)."""
        self.dht.publish(self.peers.values(), self.now)

    def view(self, delay_class: int) -> SwarmView:
        return self.dht.view(delay_class)

    # -- one step ----------------------------------------------------------------------------------

    def churn(self) -> None:
        o, r = self.o, self.rng
        while self.departures and self.departures[0][0] <= self.now:
            _, pid = heapq.heappop(self.departures)
            self.depart(pid)
        due = o.mass_leave_at_min is not None and self.now >= o.mass_leave_at_min * 60
        if due and self.result.mass_leave_at is None:
            hit = range(o.mass_leave_stages or o.stages)
            pool = sorted(pid for pid, p in self.peers.items() if p.stage in hit)
            for pid in r.sample(pool, min(len(pool), int(len(self.peers) * o.mass_leave_fraction))):
                self.depart(pid)
            self.result.mass_leave_at = self.now
        # Joins keep the population: n / session length per second on average (Poisson per step).
        lam = o.peers / (o.session_min * 60) * REFRESH_S
        for _ in range(poisson(r, lam)):
            self.join(self.new_peer())

    def settle(self) -> None:
        for p in self.peers.values():
            if p.ready_at <= self.now:
                if p.state == "leaving":
                    p.stage, p.moving_to, p.state, p.ready_at = p.moving_to, None, "joining", self.now
                elif p.state == "online" and p.moving_to is not None:  # downloaded while serving
                    p.stage, p.moving_to = p.moving_to, None
                if p.state == "joining":
                    p.state, p.serving = "online", True

    def rebalance(self) -> None:
        o = self.o
        if o.policy in ("static", "clairvoyant"):
            return
        steady = [self.steadiness[c].observe(self.view(c), self.now) for c in range(DELAY_CLASSES)]
        plans: dict[int, dict[str, int]] = {}  # the peers of one delay class read one view: one plan
        for p in list(self.peers.values()):
            if p.state != "online" or self.now < p.next_check:
                continue
            view = self.view(p.delay_class)
            if o.policy == "swarm":
                if not steady[p.delay_class]:
                    continue  # a check that falls due while the swarm is unsteady waits (peer/daemon.py)
                if p.delay_class not in plans:
                    plans[p.delay_class] = planned_moves(view, o.margin)
                target = should_move(view, self.dht.records[p.peer_id], o.margin, plan=plans[p.delay_class])
                p.next_check = self.now + self.rng.uniform(0.5, 1.5) * o.period_s
            else:
                target = petals_choice(view, p.stage, self.dht.announced(p), o.petals_quality)
                p.next_check = self.now + o.petals_period_s
            if target is not None:
                self.move(p, target)

    def route(self) -> float:
        """The pipeline's throughput this step, through the trainer's routers; counts retried calls."""
        view = self.view(DELAY_CLASSES // 2)  # the trainer reads the DHT 8 s late
        rates, failed_share = [], []
        for k, router in enumerate(self.routers):
            router.update_peers({p.peer_id: p.throughput for p in view.routable(k, self.now)}, self.now)
            plan = {s.peer_id: s.throughput for s in router.stats(self.now) if s.banned_until is None}
            total = sum(plan.values())
            live, dead, bottleneck = 0.0, 0.0, math.inf
            for pid, planned in plan.items():
                p = self.peers.get(pid)
                if p is None or p.stage != k or p.state != "online":
                    dead += planned
                    router.failed(pid, MICROBATCH, self.now)
                    continue
                live += p.effective
                bottleneck = min(bottleneck, p.effective * total / planned)
                router.done(pid, MICROBATCH, MICROBATCH / p.effective, self.now)
            rates.append(min(live, bottleneck) if live > 0 else 0.0)
            failed_share.append(dead / total if total > 0 else 0.0)
        rate = min(rates)
        ok = math.prod(1 - f for f in failed_share)
        batches = rate * REFRESH_S / MICROBATCH
        self.result.microbatches += batches
        self.result.retried += batches * (1 - ok)  # a microbatch with any failed hop is sent again
        return rate

    def count_dht(self) -> None:
        """Kademlia messages this step: every node stores its record and reads every stage's key, each a
        lookup of about log2(N) requests and as many answers."""
        n = len(self.peers) + 1  # and the trainer
        hops = max(1.0, math.log2(n))
        self.result.dht_messages += n * (1 + self.o.stages) * hops * 2
        self.result.node_seconds += n * REFRESH_S

    def step(self) -> None:
        self.churn()
        self.settle()
        self.publish()
        self.rebalance()
        achieved = self.route()
        # A newcomer's first download is no policy's doing: the oracle counts a peer once it has served.
        present = [p.effective for p in self.peers.values() if p.serving]
        self.count_dht()
        res = self.result
        res.times.append(self.now)
        res.achieved.append(achieved)
        res.oracle.append(oracle(present, self.o.stages))
        res.peer_seconds += len(self.peers) * REFRESH_S
        self.now += REFRESH_S

    def start(self) -> None:
        """The swarm at time 0: the peers have joined one after another, each picking its stage, and
        downloaded their stage."""
        self.publish()
        for _ in range(self.o.peers):
            peer = self.new_peer()
            self.join(peer)
            peer.ready_at = self.now
            self.settle()
            self.publish()
        self.settle()
        if self.o.policy == "static":
            # A plan made once for the peers at the start (DT-FM-style): the best assignment.
            peers = list(self.peers.values())
            plan = best_assignment([p.effective for p in peers], [p.stage for p in peers], self.o.stages)
            for p, k in zip(peers, plan, strict=True):
                p.stage = k
        for _ in range(DELAY_CLASSES):  # every reader, however late, sees the swarm as it starts
            self.publish()

    def recovery(self, goal: float) -> float | None:
        """Seconds from the mass departure until achieved ÷ oracle is back to `goal`."""
        at = self.result.mass_leave_at
        if at is None:
            return None
        for t, ratio in self.result.ratio_series():
            if t > at and ratio >= goal:
                return t - at
        return math.inf


def petals_choice(view: SwarmView, stage: int, speed: float, quality: float) -> int | None:
    """Petals-style: the stage whose total, with this peer moved there, gives the highest minimum; moved
    to only when the swarm's minimum now is below `quality` x that minimum."""
    totals = view.stage_throughputs()
    if sum(1 for p in view.online(stage) if p.state == "online") <= 1:
        return None
    now = min(totals)
    best, best_min = None, now
    for k in range(len(totals)):
        if k == stage:
            continue
        trial = list(totals)
        trial[stage] -= speed
        trial[k] += speed
        if min(trial) > best_min:
            best, best_min = k, min(trial)
    return best if best is not None and now < quality * best_min else None


def poisson(rng: random.Random, lam: float) -> int:
    """A Poisson draw (Knuth's method: lam here is a few at most)."""
    limit, k, prod = math.exp(-lam), 0, rng.random()
    while prod > limit:
        k += 1
        prod *= rng.random()
    return k
