"""Spot checks of forward calls, as a caller that wraps the swarm's (the policy: swarm/verify.py).

A checked training forward is also sent to a second peer of the stage, on another machine (votes
count once per host: a volunteer's side-by-side ids are one voter); when the two answers disagree a
third peer, on a third machine, arbitrates, and a peer outvoted `strikes` times is dropped from the
routing until its ban ends. Every other call passes through unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from swarm.client import StageClient
from swarm.rpc import pb
from swarm.trainer.caller import Check, ForwardSend, T, event
from swarm.trainer.membership import Membership
from swarm.verify import SpotChecks, one_per_host, tolerance
from swarm.wire import decode

if TYPE_CHECKING:  # swarm.py builds a SpotCheckCaller around its SwarmCaller
    from swarm.trainer.swarm import SwarmCaller


class SpotCheckCaller:
    """A `StageCaller`: the calls of `inner`, with a share of its forward calls checked by `spot`;
    peers it bans are dropped from `members`."""

    def __init__(self, inner: SwarmCaller, members: Membership, spot: SpotChecks):
        self.inner, self.members, self.spot = inner, members, spot
        self.run, self.trace = inner.run, inner.trace

    @property
    def failures(self) -> int:
        return self.inner.failures

    def call(
        self,
        stage: int,
        samples: int,
        fn: Callable[[StageClient], T],
        prefer: str | None = None,
        check: Check | None = None,
    ) -> tuple[T, str]:
        return self.inner.call(stage, samples, fn, prefer=prefer, check=check)

    def forward(
        self, stage: int, samples: int, name: str, train: bool, send: ForwardSend, check: Check | None = None
    ) -> tuple[pb.ForwardResponse, str]:
        peers = self.members.live(stage)
        hosts = self.members.hosts(stage)

        def host(p: str) -> str:
            return hosts.get(p, p)

        if not train or len(one_per_host(peers, host)) < 2 or not self.spot.due(stage, name, peers):
            return self.inner.forward(stage, samples, name, train, send, check)
        call = self.inner.call
        last = stage == self.run.stages.count - 1
        # On an inner stage a training forward only records its graph (the gradient comes with the
        # backward, which goes to the peer whose answer is used), so the check is a training forward
        # too: a peer cannot tell the checked calls from the others. On the last stage a training
        # forward adds to the stage's gradient, so its check stays an evaluation forward.
        as_training = not last
        # The check goes first: on the last stage the training forward completes the microbatch's
        # gradient, the stage may step right after it, and a check sent then could see the next
        # step's weights.
        second, checker = call(
            stage, samples, lambda c: send(c, as_training), prefer=self.spot.checker(stage, peers), timed=False
        )
        # (The checker's answer is not checked here: a malformed one loses the comparison below.)
        beside = {p for p in peers if host(p) == host(checker)}  # one machine's ids are one voter
        out, peer = call(stage, samples, lambda c: send(c, True), avoid=beside | {checker}, check=check)
        if host(peer) == host(checker):  # no peer of another machine could answer: nothing to compare
            return out, peer
        rtol = self.run.verify.rtol or tolerance(self.run.wire.codec, self.run.model.dtype, encoded=not last)

        def arbiter() -> tuple[str, torch.Tensor] | None:
            voted = {host(peer), host(checker)}
            others = one_per_host([p for p in peers if p not in self.spot.banned], host, taken=voted)
            if not others:
                return None
            third, who = call(
                stage,
                samples,
                lambda c: send(c, as_training),
                prefer=self.spot.checker(stage, others),
                avoid={p for p in peers if host(p) in voted},
                timed=False,
            )
            return (who, _answer(third, last)) if host(who) not in voted else None

        answers = [(peer, _answer(out, last)), (checker, _answer(second, last))]
        verdict = self.spot.judge(stage, answers, rtol, arbiter)
        if verdict.banned:
            self.members.drop(stage, verdict.odd)
            event(f"spot check: banned peer {verdict.odd} of stage {stage} at microbatch {name}")
        if verdict.odd == peer and not last:
            return second, checker  # pass the agreed hidden states on, not the outvoted ones
        return out, peer

    def served(self, stage: int, peer: str, samples: int) -> None:
        self.inner.served(stage, peer, samples)

    def ceiling(self) -> int | None:
        return self.inner.ceiling()

    def host(self, stage: int, peer: str) -> str:
        return self.inner.host(stage, peer)

    def paused(self) -> bool:
        return self.inner.paused()

    def bytes_on_wire(self) -> int:
        return self.inner.bytes_on_wire()

    def counts(self) -> dict:
        return {
            **self.inner.counts(),
            "spot_checks": self.spot.checks,
            "spot_disagreements": self.spot.disagreements,
            "spot_bans": self.spot.bans,
        }

    def close(self) -> None:
        self.inner.close()


def _answer(response: pb.ForwardResponse, last: bool) -> torch.Tensor:
    """What a check compares: the hidden states, or on the last stage the microbatch's loss."""
    return torch.tensor([response.loss]) if last else decode(response.output, "output")
