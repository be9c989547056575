"""Spot checks of the peers' training answers: a pure policy over observed answers.

The trainer sends a fraction of its training calls to a second peer of the same stage as well and
compares the two answers: hidden states on the inner stages, the microbatch's loss and input
gradient on the last stage, the input gradient of a Backward. The second answer keeps no gradient
where the call would add one (swarm/trainer/spotcheck.py). Both peers got the same input bytes and
hold the same weights (the replicas of a stage apply the same averaged step), so honest answers
differ only by floating-point noise (batching, kernels) and by the wire codec's rounding; the
tolerance is derived from those two.

When two answers disagree, a third peer of the stage arbitrates: the peer whose answer disagrees
with both others while those two agree is the odd one out and gets a strike; after `strikes`
strikes it is banned from this trainer's routing for `ban_s` seconds (0: for the rest of the run).
A ban ends because an honest replica can be outvoted too: one that missed its stage's all-reduce
answers with weights that are not the stage's until it takes the stage's state again. When the ban
ends the peer starts over: no strikes, and every call of its stage is checked until it passes
`first_checks` checks, so a liar is banned again within its next `strikes` checked calls. With only two peers (or
when the third disagrees with both) nobody can tell which one is wrong: the disagreement is
counted and nobody is banned, so one peer can never get an honest peer banned on its own word.

Which calls are checked is decided by a keyed hash (HMAC) of the stage and the microbatch's name
under a secret that only the trainer holds (drawn anew for each trainer), so a peer cannot work out
which of its calls are checked: the microbatch ids it sees are keyed hashes too (`opaque_id`), and a
training call a liar would corrupt cannot be told from an unchecked one (swarm/trainer/spotcheck.py).
Besides, while a peer of the stage has passed fewer than `first_checks`
checks since it joined or was last outvoted, every call of the stage is checked, the peer with the
fewest passed checks answering as the second one: a new peer is checked at once, and an outvoted
one until it agrees again or collects its next strike, even at a small fraction.

Nothing here touches the network: the trainer asks, this module keeps the counts and judges.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch

# Relative error, ||a - b|| / max(||a||, ||b||), that floating-point noise alone can cause between two
# honest answers computed in this dtype (batching changes the order of sums; devices differ).
DTYPE_RTOL = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 3e-2}

# What the wire codec's rounding adds when the answers travel encoded: about one step of the
# codec's mantissa (fp16: 2^-11, bf16: 2^-8) or of its 8-bit grid (int8: absmax / 127 per
# block of 256), with a margin, since two close values may round to neighbouring codes.
CODEC_RTOL = {"none": 0.0, "fp16": 2e-3, "bf16": 1e-2, "int8": 3e-2}


# The last stage's loss is a mean over every token of the microbatch: batching noise all but
# averages out of it (float32: below 1e-6), while a corrupted answer moves it by far more than the
# noise does (noise of 0.5 x the logits' RMS: +0.2% at the seeded init, more once trained).
LOSS_RTOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}


def tolerance(codec: str, dtype: str, encoded: bool = True) -> float:
    """The relative tolerance for answers computed in `dtype`; `encoded`: hidden states that crossed
    the wire through `codec`, else the last stage's loss (a plain float, whatever the codec)."""
    return DTYPE_RTOL[dtype] + CODEC_RTOL[codec] if encoded else LOSS_RTOL[dtype]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / max(||a||, ||b||); infinite when the shapes differ or a value is not finite."""
    if a.shape != b.shape:
        return float("inf")
    a, b = a.double(), b.double()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("inf")
    scale = max(float(a.norm()), float(b.norm()))
    diff = float((a - b).norm())
    return 0.0 if diff == 0 else diff / scale


def sampled(key: bytes, stage: int, name: str, fraction: float) -> bool:
    """Whether the call of microbatch `name` to `stage` is one of the `fraction` checked: a keyed hash
    of the two under the trainer's secret `key`, which nobody else can compute (a hash of public
    values, such as the run's seed, lets a peer lie exactly where nobody looks)."""
    if fraction <= 0:
        return False
    digest = hmac.new(key, f"check/{stage}/{name}".encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def opaque_id(key: bytes, name: str) -> str:
    """The id a peer sees for microbatch `name` (e.g. "12.3", step and index): a keyed hash that says
    neither, so that the calls a trainer checks cannot be told from the others by their ids."""
    return hmac.new(key, f"id/{name}".encode(), hashlib.sha256).hexdigest()[:16]


def new_key() -> bytes:
    """A trainer's secret for `sampled` and `opaque_id`."""
    return secrets.token_bytes(32)


def one_per_host(peers: Sequence[str], host_of: Callable[[str], str], taken: Collection[str] = ()) -> list[str]:
    """`peers` less those on a host in `taken` or on the host of an earlier one: votes count once per
    machine, so that ids a volunteer runs side by side (Sybils) cannot outvote an honest peer."""
    seen, kept = set(taken), []
    for peer in peers:
        host = host_of(peer)
        if host not in seen:
            seen.add(host)
            kept.append(peer)
    return kept


# What a check compares: one tensor, or several (the last stage's loss and input gradient), each
# within its own tolerance.
Answer = torch.Tensor | tuple[torch.Tensor, ...]


def agree(a: Answer, b: Answer, rtol: float | tuple[float, ...]) -> bool:
    """Whether two answers agree: every part within its tolerance (`rtol`: one for all, or one each);
    answers of different parts never do."""
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    rtols = rtol if isinstance(rtol, tuple) else (rtol,) * len(a)
    if not len(a) == len(b) == len(rtols):
        return False
    return all(relative_error(x, y) <= r for x, y, r in zip(a, b, rtols, strict=True))


def odd_one_out(answers: Sequence[Answer], agree: Callable[[Answer, Answer], bool]) -> int | None:
    """The index of the one answer that disagrees with every other while all the others agree with
    each other; None when there is no such answer (all agree, or no majority, or fewer than 3)."""
    if len(answers) < 3:
        return None
    n = len(answers)
    ok = [[i == j or agree(answers[i], answers[j]) for j in range(n)] for i in range(n)]
    for odd in range(n):
        rest = [i for i in range(n) if i != odd]
        if all(not ok[odd][i] for i in rest) and all(ok[i][j] for i in rest for j in rest):
            return odd
    return None


@dataclass(frozen=True)
class Verdict:
    agreed: bool  # the first two answers agreed
    odd: str | None = None  # the peer outvoted by the others
    banned: bool = False  # ... and banned by this verdict


@dataclass
class _StageState:
    passed: dict[str, int] = field(default_factory=dict)  # checks each peer passed since it was last outvoted
    strikes: dict[str, int] = field(default_factory=dict)


class SpotChecks:
    """What one trainer knows from its spot checks: per stage, how often each peer was checked and
    outvoted; which peers it banned; the totals it reports."""

    def __init__(
        self,
        num_stages: int,
        fraction: float,
        strikes: int = 2,
        first_checks: int = 2,
        ban_s: float = 0.0,
        key: bytes | None = None,
    ):
        """`key`: the secret that picks the checked calls (default: a new random one)."""
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must be in [0, 1], got {fraction}")
        if strikes < 1:
            raise ValueError(f"strikes must be >= 1, got {strikes}")
        self.fraction, self.strikes, self.first_checks = fraction, strikes, first_checks
        self.key = new_key() if key is None else key
        self.ban_s = ban_s
        self.stages = [_StageState() for _ in range(num_stages)]
        self.banned: dict[str, int] = {}  # peer id -> the stage it is banned on (now)
        self.ban_ends: dict[str, float] = {}  # peer id -> when its ban ends (time.monotonic())
        self.bans = 0  # bans so far (a peer banned again counts again)
        self.checks = 0  # comparisons made
        self.disagreements = 0  # ... where the first two answers differed
        self.unresolved = 0  # ... and no third answer settled which one was wrong
        self._lock = threading.Lock()  # the trainer's microbatch threads judge at the same time

    def enabled(self) -> bool:
        return self.fraction > 0

    def due(self, stage: int, name: str, peers: Collection[str]) -> bool:
        """Whether this call is checked: it is sampled, or a live peer of the stage is still new."""
        if not self.enabled() or len(peers) < 2:
            return False
        passed = self.stages[stage].passed
        return sampled(self.key, stage, name, self.fraction) or any(passed.get(p, 0) < self.first_checks for p in peers)

    def checker(self, stage: int, peers: Collection[str], name: str = "") -> str | None:
        """The peer to answer the check of call `name`: the one with the fewest passed checks, ties
        broken by a keyed hash of the call and the peer. Broken by id, the peer whose id sorts first
        could answer the check of every call of a stage of three and never a training call: a liar
        with such an id was never caught lying in one."""
        candidates = [p for p in peers if p not in self.banned]
        passed = self.stages[stage].passed

        def draw(peer: str) -> bytes:
            return hmac.new(self.key, f"checker/{stage}/{name}/{peer}".encode(), hashlib.sha256).digest()

        return min(candidates, key=lambda p: (passed.get(p, 0), draw(p)), default=None)

    def release(self, now: float | None = None) -> list[str]:
        """End the bans that are due (see the module docstring); returns those peers."""
        now = time.monotonic() if now is None else now
        with self._lock:
            ended = [p for p, end in self.ban_ends.items() if end <= now]
            for peer in ended:
                stage = self.banned.pop(peer)
                del self.ban_ends[peer]
                self.stages[stage].strikes.pop(peer, None)
                self.stages[stage].passed.pop(peer, None)
        return ended

    def judge(
        self,
        stage: int,
        answers: Sequence[tuple[str, Answer]],
        rtol: float | tuple[float, ...],
        arbiter: Callable[[], tuple[str, Answer] | None] = lambda: None,
        now: float | None = None,
    ) -> Verdict:
        """Judge one spot check from two peers' answers (peer id, answer); when they disagree,
        `arbiter` is asked for a third peer's (None: there is none). `rtol`: see `agree`."""

        def same(a: Answer, b: Answer) -> bool:
            return agree(a, b, rtol)

        agreed = same(answers[0][1], answers[1][1])
        if not agreed and (third := arbiter()) is not None:
            answers = [*answers, third]
        odd = None if agreed else odd_one_out([a for _, a in answers], same)
        state = self.stages[stage]
        with self._lock:
            self.checks += 1
            if not agreed:
                self.disagreements += 1
                self.unresolved += odd is None
            if agreed or odd is not None:
                for i, (peer, _) in enumerate(answers):
                    if i != odd:
                        state.passed[peer] = state.passed.get(peer, 0) + 1
            if odd is None:
                return Verdict(agreed=agreed)
            peer = answers[odd][0]
            return Verdict(agreed=False, odd=peer, banned=self._strike(stage, peer, now))

    def strike(self, stage: int, peer: str, now: float | None = None) -> bool:
        """`peer` of `stage` gave an answer that cannot be used (swarm/trainer/swarm.py checks each):
        a strike, as when outvoted; whether it is banned now."""
        with self._lock:
            return self._strike(stage, peer, now)

    def convict(self, stage: int, peer: str, now: float | None = None) -> bool:
        """`peer` of `stage` proved itself a liar (it signed a claim no honest peer makes): banned at
        once; whether it was not banned already."""
        with self._lock:
            if peer in self.banned:
                return False
            self.stages[stage].strikes[peer] = self.strikes - 1
            return self._strike(stage, peer, now)

    def _strike(self, stage: int, peer: str, now: float | None) -> bool:
        state = self.stages[stage]
        state.passed[peer] = 0
        state.strikes[peer] = state.strikes.get(peer, 0) + 1
        banned = state.strikes[peer] >= self.strikes and peer not in self.banned
        if banned:
            self.banned[peer] = stage
            self.bans += 1
            if self.ban_s > 0:
                self.ban_ends[peer] = (time.monotonic() if now is None else now) + self.ban_s
        return banned
