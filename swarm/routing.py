"""Which peer of a pipeline stage gets the next microbatch: a pure policy over observed state.

SWARM routes each microbatch through one peer per stage, choosing the peer that is expected to finish it first
("interleaved weighted round robin"). The estimate is `max(now, busy_until) + samples / throughput`: because
`pick` reserves the work it hands out, a peer three times faster absorbs three times as many of the microbatches
kept in flight, without any explicit weights. Peers that fail are banned with exponential back-off and come back
when the ban expires; one success forgives them. A ban is a preference, not a refusal: when every usable peer of a
stage is banned, the one whose ban ends first is asked rather than none (a stage whose only live peer failed once,
say in a slow all-reduce, must not stall the trainer for the whole back-off).

Each call's deadline follows the peer's measured latency (`deadline`): a few times the slowest of its recent calls,
never less than the caller's floor (the trainer's is the longest a stage may hold a call during its optimizer step:
swarm/trainer/swarm.py, `step_hold_s`), so a peer that froze is given up on in seconds, while one that is merely
busy is not.

Nothing here touches the network, threads or the clock: every method that needs the time takes `now` (seconds),
so the policy is deterministic and can be tested with a virtual clock.
"""

import math
from collections.abc import Collection
from dataclasses import dataclass

# A call reported as taking no time at all (coarse clock, clock step) must not yield an infinite throughput.
MIN_SECONDS = 1e-6

# 2.0 ** 1024 overflows a float; any exponent this large is far past every sensible cap anyway.
_MAX_EXPONENT = 1000


def backoff(failures: int, base: float, cap: float) -> float:
    """Ban length after `failures` consecutive failures: base, 2*base, 4*base ... never more than `cap`."""
    if failures < 1:
        return 0.0
    return min(base * 2.0 ** min(failures - 1, _MAX_EXPONENT), cap)


@dataclass(frozen=True)
class PeerStats:
    """A snapshot of what the router believes about one peer, for progress lines and debugging."""

    peer_id: str
    throughput: float  # samples/s the router plans with (observed, else announced, else the optimistic stand-in)
    outstanding: int  # samples handed out and not yet answered
    failures: int  # consecutive failures since the last success
    banned_until: float | None  # None when not banned at the time of the snapshot
    measured: bool = False  # True once the trainer has observed the peer itself


@dataclass
class _Peer:
    announced: float  # samples/s the peer announced in the DHT; 0.0 when it has not measured itself yet
    busy_until: float  # when the work already reserved on it is expected to be done
    observed: float | None = None  # moving average of the throughput the trainer measured
    latency: float | None = None  # slowest recent call, seconds (decays toward newer ones)
    outstanding: int = 0
    failures: int = 0
    banned_until: float = -math.inf
    failed_at: float = -math.inf  # when the last failure that counted toward the back-off was reported

    def known_throughput(self) -> float | None:
        """Our own measurement beats the peer's claim; None when there is neither."""
        if self.observed is not None:
            return self.observed
        return self.announced if self.announced > 0 else None


def _check_samples(samples: int) -> None:
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")


class Router:
    """Routing state of one pipeline stage, kept by the trainer."""

    # How a peer's latency forgets a slow call: each later call keeps this much of it. Slowly, because the
    # slow calls recur: the first ones of every global step wait for the stage's optimizer step (a few per 40
    # calls of configs/tiny.toml), and forgetting them between steps would time out the next step's.
    LATENCY_DECAY = 0.98

    def __init__(self, ema_alpha: float = 0.3, ban_base_s: float = 1.0, ban_max_s: float = 60.0) -> None:
        if not 0.0 < ema_alpha <= 1.0:
            raise ValueError(f"ema_alpha must be in (0, 1], got {ema_alpha}")
        if not 0.0 < ban_base_s <= ban_max_s:
            raise ValueError(f"need 0 < ban_base_s <= ban_max_s, got {ban_base_s} and {ban_max_s}")
        self.ema_alpha = ema_alpha
        self.ban_base_s = ban_base_s
        self.ban_max_s = ban_max_s
        self._peers: dict[str, _Peer] = {}

    @property
    def peers(self) -> list[str]:
        return sorted(self._peers)

    def update_peers(self, announced: dict[str, float], now: float) -> None:
        """Replace the set of live peers with what the DHT announces (peer_id -> announced samples/s)."""
        # A peer that left the DHT is gone: if it rejoins it starts afresh, without old bans or stale speeds.
        for peer_id in list(self._peers):
            if peer_id not in announced:
                del self._peers[peer_id]
        for peer_id, throughput in announced.items():
            # Negative or NaN announcements are garbage; treat them like "not measured yet".
            claimed = throughput if math.isfinite(throughput) and throughput > 0 else 0.0
            peer = self._peers.get(peer_id)
            if peer is None:
                self._peers[peer_id] = _Peer(announced=claimed, busy_until=now)
            else:
                # Keep what we observed ourselves; the announcement only matters until then.
                peer.announced = claimed

    def remove(self, peer: str) -> None:
        """Forget `peer` until `update_peers` lists it again (a caller that bans it for good stops listing it)."""
        self._peers.pop(peer, None)

    def is_banned(self, peer: str, now: float) -> bool:
        state = self._peers.get(peer)
        return state is not None and now < state.banned_until

    def pick(self, samples: int, now: float, exclude: Collection[str] = (), banned_ok: bool = False) -> str | None:
        """Reserve `samples` on the usable peer expected to finish them first; None when no peer is usable.
        `banned_ok`: when every peer not excluded is banned, take the one whose ban ends first."""
        _check_samples(samples)
        stand_in = self._stand_in_throughput()
        best: tuple[float, str] | None = None
        for peer_id, peer in self._peers.items():
            if peer_id in exclude or now < peer.banned_until:
                continue
            finish = max(now, peer.busy_until) + samples / self._throughput(peer, stand_in)
            # Comparing (finish, id) tuples breaks ties by peer id, so the choice never depends on dict order.
            if best is None or (finish, peer_id) < best:
                best = (finish, peer_id)
        if best is None and banned_ok:
            banned = [(peer.banned_until, peer_id) for peer_id, peer in self._peers.items() if peer_id not in exclude]
            if banned:
                _, peer_id = min(banned)
                peer = self._peers[peer_id]
                best = (max(now, peer.busy_until) + samples / self._throughput(peer, stand_in), peer_id)
        if best is None:
            return None
        finish, peer_id = best
        chosen = self._peers[peer_id]
        chosen.busy_until = finish
        chosen.outstanding += samples
        return peer_id

    def deadline(self, peer: str, floor: float, cap: float, factor: float = 4.0) -> float:
        """Seconds to give a call to `peer`: `factor` x its slowest recent call (which includes the
        waits of its stage's optimizer steps), within [floor, cap]; `cap` until one call came back."""
        state = self._peers.get(peer)
        if state is None or state.latency is None:
            return cap
        return min(cap, max(floor, factor * state.latency))

    def answered(self, peer: str, seconds: float) -> None:
        """A call to `peer` (any kind) came back after `seconds` in all, its queue included."""
        state = self._peers.get(peer)
        if state is not None and math.isfinite(seconds) and seconds >= 0:
            decayed = state.latency * self.LATENCY_DECAY if state.latency is not None else 0.0
            state.latency = max(seconds, decayed)

    def done(self, peer: str, samples: int, seconds: float, now: float) -> None:
        """A call to `peer` with `samples` samples succeeded after `seconds`."""
        _check_samples(samples)
        state = self._peers.get(peer)
        if state is None:  # forgotten while the call was in flight; nothing to learn about a departed peer
            return
        if not seconds > 0:  # also catches NaN
            seconds = MIN_SECONDS
        measured = samples / seconds
        if state.observed is None:
            state.observed = measured  # the first measurement beats any announcement or guess
        else:
            state.observed = self.ema_alpha * measured + (1 - self.ema_alpha) * state.observed
        state.failures = 0
        state.banned_until = -math.inf
        self._release(state, samples, now)

    def returned(self, peer: str, samples: int, now: float) -> None:
        """A call to `peer` answered that says nothing of its training speed (an evaluation forward, far
        cheaper than a training call): release the reserved work, learn nothing from the time it took."""
        _check_samples(samples)
        state = self._peers.get(peer)
        if state is not None:
            self._release(state, samples, now)

    def failed(self, peer: str, samples: int, now: float, started: float | None = None) -> float:
        """A call to `peer` failed or timed out: ban it with exponential back-off. Returns the ban length (s).

        `started`: when the call was sent. A call sent before the peer's last counted failure was already in
        flight when that failure was learned, so it says nothing new: a burst of calls that all time out
        together (a stage busy with its optimizer step) is one failure, not a ban of `ban_max_s`."""
        _check_samples(samples)
        state = self._peers.get(peer)
        if state is None:
            return 0.0
        if started is not None and started < state.failed_at:
            self._release(state, samples, now)
            return max(0.0, state.banned_until - now)
        state.failures += 1
        state.failed_at = now
        ban = backoff(state.failures, self.ban_base_s, self.ban_max_s)
        state.banned_until = now + ban
        self._release(state, samples, now)
        return ban

    def stats(self, now: float) -> list[PeerStats]:
        stand_in = self._stand_in_throughput()
        return [
            PeerStats(
                peer_id=peer_id,
                throughput=self._throughput(peer, stand_in),
                outstanding=peer.outstanding,
                failures=peer.failures,
                banned_until=peer.banned_until if now < peer.banned_until else None,
                measured=peer.observed is not None,
            )
            for peer_id, peer in sorted(self._peers.items())
        ]

    def _stand_in_throughput(self) -> float:
        """Throughput assumed for a peer we know nothing about: the best of the stage, so it is tried early."""
        known = [t for p in self._peers.values() if (t := p.known_throughput()) is not None]
        return max(known, default=1.0)

    @staticmethod
    def _throughput(peer: _Peer, stand_in: float) -> float:
        known = peer.known_throughput()
        return stand_in if known is None else known

    @staticmethod
    def _release(peer: _Peer, samples: int, now: float) -> None:
        """Return reserved work; clamped at 0 because a reply may belong to a peer that was re-added meanwhile."""
        peer.outstanding = max(0, peer.outstanding - samples)
        if peer.outstanding == 0:
            # Nothing in flight: the peer is idle now, whatever our estimate said, so estimates don't drift.
            peer.busy_until = now


class Lanes:
    """Pinned paths (`[averaging] paths = "pinned"`): which replica of stage k takes the microbatches that a
    given replica of stage k - 1 served, so that each replica trains beside the same replicas of the other
    stages. Under DiLoCo the replicas of a stage hold weights of their own between two outer steps; a
    replica of stage k - 1 whose outputs feed one replica of stage k learns against that replica's weights
    only, as a worker of DiLoCo trains its whole model alone.

    A replica of stage k - 1 is paired with a replica of stage k the first time one of its microbatches
    is routed on: the router picks among the replicas of stage k not paired yet (`taken` is what to
    avoid), then `pin` records whoever served it. A pair ends when either replica leaves the stage's
    routing, and moves when the partner failed and the call went elsewhere. Pure: no locks, no clock."""

    def __init__(self) -> None:
        self._pairs: dict[int, dict[str, str]] = {}  # stage k -> {replica of stage k - 1: replica of stage k}

    def partner(self, stage: int, after: str, previous: Collection[str], current: Collection[str]) -> str | None:
        """The replica of `stage` that `after` (of stage - 1) feeds, None when unpaired; pairs of replicas
        no longer routed to (`previous`: stage - 1's, `current`: stage's) are dropped first."""
        pairs = self._pairs.setdefault(stage, {})
        for prev, cur in list(pairs.items()):
            if prev not in previous or cur not in current:
                del pairs[prev]
        return pairs.get(after)

    def taken(self, stage: int) -> set[str]:
        """Replicas of `stage` already paired: a replica of stage - 1 not paired yet avoids them."""
        return set(self._pairs.get(stage, {}).values())

    def pin(self, stage: int, after: str, peer: str) -> None:
        """`peer` of `stage` served a microbatch that `after` of stage - 1 served before it."""
        self._pairs.setdefault(stage, {})[after] = peer
