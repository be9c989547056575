"""Spot checks of training calls, as a caller that wraps the swarm's (the policy: swarm/verify.py).

A checked call is also sent to a second peer of the stage, on another machine (votes count once per
host: a volunteer's side-by-side ids are one voter), and the two answers are compared: an inner
stage's hidden states, the last stage's loss and input gradient, a Backward's input gradient. When
they disagree a third peer, on a third machine, arbitrates, and a peer outvoted `strikes` times is
dropped from the routing until its ban ends. Every other call passes through unchanged.

The second answer must look like any training call to the peer that gives it, or a liar would lie
only where it is not asked twice. An inner stage's check is a training forward (it only records a
graph: the gradient comes with the backward, sent to one of the two). A call that adds to the
stage's gradient (the last stage's forward, a Backward) is asked of the second peer as a `check`,
which keeps no gradient, so nothing is counted twice; the training call itself, the one a liar would
corrupt, cannot be told from an unchecked one. When the training answer is outvoted, the trainer
takes its gradient back (`Retract`, honoured while the stage has not stepped with it; a liar may
ignore it, and then holds one microbatch more than its receipts say) and has the microbatch redone
on a peer that agreed, whose answer is checked against the agreed one in turn.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc
import torch

from swarm.client import StageClient
from swarm.rpc import pb
from swarm.trainer.caller import BackwardSend, Check, ForwardSend, T, event
from swarm.trainer.membership import Membership
from swarm.verify import LOSS_RTOL, Answer, SpotChecks, agree, one_per_host, tolerance
from swarm.wire import WireError, decode

if TYPE_CHECKING:  # swarm.py builds a SpotCheckCaller around its SwarmCaller
    from swarm.trainer.swarm import SwarmCaller


class SpotCheckCaller:
    """A `StageCaller`: the calls of `inner`, with a share of its training calls checked by `spot` (and
    settled by a `Referee`); peers it bans are dropped from `members`."""

    def __init__(self, inner: SwarmCaller, members: Membership, spot: SpotChecks):
        self.inner, self.members, self.spot = inner, members, spot
        self.run, self.trace = inner.run, inner.trace
        self.referee = Referee(inner, members, spot)

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
        self,
        stage: int,
        samples: int,
        name: str,
        train: bool,
        send: ForwardSend,
        check: Check | None = None,
        mb_id: str = "",
        after: str | None = None,
    ) -> tuple[pb.ForwardResponse, str]:
        last = stage == self.run.stages.count - 1
        if not train or not self._due(stage, name):
            return self.inner.forward(stage, samples, name, train, send, check, mb_id, after)
        if not last:  # the check is a training forward too; the gradient comes with the backward
            return self.referee.checked(
                stage, samples, name, mb_id, lambda c: send(c, True), lambda c: send(c, True), self._rtol(), check
            )
        rtols = (LOSS_RTOL[self.run.model.dtype], self._rtol())
        return self.referee.checked(
            stage,
            samples,
            name,
            mb_id,
            lambda c: send(c, True),
            lambda c: send(c, False, True),
            rtols if stage > 0 else rtols[:1],
            check,
            accumulates=True,
        )

    def backward(
        self,
        stage: int,
        samples: int,
        name: str,
        send: BackwardSend,
        prefer: str | None = None,
        check: Check | None = None,
        mb_id: str = "",
    ) -> tuple[pb.BackwardResponse, str]:
        # Stage 0 answers no input gradient (token ids have none): nothing to compare.
        if stage == 0 or not self._due(stage, f"{name}/backward"):
            return self.inner.backward(stage, samples, name, send, prefer, check, mb_id)
        return self.referee.checked(
            stage,
            samples,
            name,
            mb_id,
            lambda c: send(c, False),
            lambda c: send(c, True),
            self._rtol(),
            check,
            prefer=prefer,
            accumulates=True,
        )

    def _due(self, stage: int, name: str) -> bool:
        a = self.run.averaging
        if a.mode == "diloco" and int(name.split(".", 1)[0]) % a.inner_steps:
            # Between two outer steps each replica of a stage holds weights of its own: answers agree
            # only in a phase's first step, when every replica starts from the outer weights.
            return False
        peers = self.members.live(stage)
        hosts = self.members.hosts(stage)
        return len(one_per_host(peers, lambda p: hosts.get(p, p))) >= 2 and self.spot.due(stage, name, peers)

    def _rtol(self) -> float:
        return self.run.verify.rtol or tolerance(self.run.wire.codec, self.run.model.dtype)

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
            "spot_unresolved": self.spot.unresolved,
            "spot_bans": self.spot.bans,
            "outvoted_taken_back": self.referee.taken_back,
            "outvoted_kept": self.referee.kept_outvoted,
            "redone": self.referee.redone,
        }

    def close(self) -> None:
        self.inner.close()


class Referee:
    """Settles checked training calls: a second peer's answer to the same request, a third's when the
    two disagree, and, for a training answer outvoted, its gradient taken back and the microbatch
    redone on a peer that agreed; a peer outvoted `strikes` times is dropped from `members`."""

    def __init__(self, inner: SwarmCaller, members: Membership, spot: SpotChecks):
        self.inner, self.members, self.spot = inner, members, spot
        self.taken_back = 0  # outvoted training answers whose gradient their peer took back
        self.kept_outvoted = 0  # ... whose peer did not (a liar, gone, or the stage had stepped)
        self.redone = 0  # microbatches redone on another peer after an outvoted training answer

    def checked(
        self,
        stage: int,
        samples: int,
        name: str,
        mb_id: str,
        train: Callable[[StageClient], T],
        ask: Callable[[StageClient], T],
        rtol: float | tuple[float, ...],
        check: Check | None = None,
        prefer: str | None = None,
        accumulates: bool = False,
    ) -> tuple[T, str]:
        """A training call (`train`) compared with a second peer's answer to the same request
        (`ask`), and a third's when they disagree (by more than `rtol`); the answer to use and its peer.
        `prefer`: the training call's peer, when it can; `accumulates`: the training call adds to the
        stage's gradient (its second answers keep none), so an outvoted one is taken back and redone."""
        peers = self.members.live(stage)
        hosts = self.members.hosts(stage)

        def host(p: str) -> str:
            return hosts.get(p, p)

        def beside(p: str) -> set[str]:  # one machine's ids are one voter
            return {q for q in peers if host(q) == host(p)}

        call = self.inner.call
        # The second answer comes first: once the training call's gradient is kept, the stage may
        # step, and an answer computed after that would be of the next step's weights.
        # (It is not checked here: a malformed one loses the comparison below.)
        candidates = [p for p in peers if prefer is None or host(p) != host(prefer)]
        second, checker = call(
            stage,
            samples,
            ask,
            prefer=self.spot.checker(stage, candidates, name),
            avoid=beside(prefer) if prefer else (),
            timed=False,
        )
        out, peer = call(stage, samples, train, prefer=prefer, avoid=beside(checker) | {checker}, check=check)
        if host(peer) == host(checker):  # no peer of another machine could answer: nothing to compare
            return out, peer
        answers = [(peer, _answer(out)), (checker, _answer(second))]
        responses = {peer: out, checker: second}

        def arbiter() -> tuple[str, Answer] | None:
            # Any routed peer of a third machine, the ones the router has set aside for a moment (a
            # slow answer, a timeout) included: without them the check would stay undecided, and
            # the training answer go on unjudged.
            voted = {host(peer), host(checker)}
            routed = [p for p in hosts if p not in self.spot.banned]
            others = one_per_host(routed, host, taken=voted)
            if not others:
                return None
            third, who = call(
                stage,
                samples,
                ask,
                prefer=self.spot.checker(stage, others, name),
                avoid={p for p in routed if host(p) in voted},
                timed=False,
                strict=True,
            )
            if host(who) in voted:
                return None
            answers.append((who, _answer(third)))
            responses[who] = third
            return answers[-1]

        verdict = self.spot.judge(stage, answers[:2], rtol, arbiter)
        if not verdict.agreed and verdict.odd is None:
            event(
                f"spot check: stage {stage}'s answers to {name} from {peer} and {checker} disagree, "
                "and no third machine could settle it"
            )
        if verdict.odd is not None:
            role = "training" if verdict.odd == peer else "check"
            event(f"spot check: peer {verdict.odd} of stage {stage} outvoted on its {role} answer to {name}")
        if verdict.odd != peer:
            if verdict.odd is not None:
                self._banned(stage, name, verdict.odd, verdict.banned)
            return out, peer
        agreed = [(p, a) for p, a in answers if p != peer]
        if not accumulates:  # nothing kept on the outvoted peer: pass the agreed answer on
            self._banned(stage, name, peer, verdict.banned)
            return second, checker
        taken_back = self._take_back(stage, peer, mb_id)
        self._banned(stage, name, peer, verdict.banned)
        if not taken_back:
            # The stage stepped with the outvoted gradient (or its peer would not take it back): redone
            # elsewhere, the microbatch would count twice. What goes on upstream is the agreed answer.
            return responses[agreed[0][0]], peer
        return self._redo(stage, samples, name, mb_id, train, check, agreed, responses, {host(peer)}, host, rtol)

    def _redo(
        self,
        stage: int,
        samples: int,
        name: str,
        mb_id: str,
        train: Callable[[StageClient], T],
        check: Check | None,
        agreed: list[tuple[str, Answer]],
        responses: dict[str, T],
        tried: set[str],
        host: Callable[[str], str],
        rtol: float | tuple[float, ...],
    ) -> tuple[T, str]:
        """The training call of a microbatch whose training answer was outvoted, made again on a peer
        whose answer agreed, and on the next while the new answer disagrees with the agreed one (a
        liar can answer a check honestly and lie in training calls). A disagreeing answer never goes
        on upstream: once every machine was tried, the agreed answer does (the gradient stays on the
        last peer asked, as when an outvoted one cannot be taken back)."""
        self.redone += 1
        expected = agreed[0][1]
        while True:
            prefer = next((p for p, _ in agreed if host(p) not in tried), None)
            avoid = {p for p in self.members.live(stage) if host(p) in tried}
            out, peer = self.inner.call(stage, samples, train, prefer=prefer, avoid=avoid, check=check, strict=True)
            if agree(_answer(out), expected, rtol):
                return out, peer
            if host(peer) in tried:  # no other machine left to ask
                event(f"spot check: peer {peer} of stage {stage} disagreed again on {name}; the agreed answer goes on")
                return responses[agreed[0][0]], peer
            tried.add(host(peer))
            event(f"spot check: peer {peer} of stage {stage} outvoted on its redone training answer to {name}")
            taken_back = self._take_back(stage, peer, mb_id)
            self._banned(stage, name, peer, self.spot.strike(stage, peer))
            if not taken_back:
                return responses[agreed[0][0]], peer  # (as in `checked`: redone again, it would count twice)

    def _take_back(self, stage: int, peer: str, mb_id: str) -> bool:
        """Ask `peer` to take back the gradient its training call of microbatch `mb_id` kept; whether it did."""
        try:
            self.inner.direct(stage, peer, lambda c: c.retract(stage, mb_id))
        except (grpc.RpcError, LookupError) as err:
            self.kept_outvoted += 1
            why = err.details() if isinstance(err, grpc.RpcError) else str(err)
            event(f"spot check: peer {peer} of stage {stage} kept its outvoted gradient of {mb_id}: {why}")
            return False
        self.taken_back += 1
        return True

    def _banned(self, stage: int, name: str, peer: str, banned: bool) -> None:
        if banned:
            self.members.drop(stage, peer)
            event(f"spot check: banned peer {peer} of stage {stage} at microbatch {name}")


def _answer(response: pb.ForwardResponse | pb.BackwardResponse) -> Answer:
    """What a check compares: a forward's hidden states, or its loss (and input gradient: the last
    stage), or a Backward's input gradient. A part that does not decode compares as NaN (never equal)."""

    def part(msg: pb.Tensor, field: str) -> torch.Tensor:
        try:
            return decode(msg, field)
        except WireError:
            return torch.tensor([float("nan")])

    if isinstance(response, pb.BackwardResponse):
        return (part(response.input_grad, "input_grad"),)
    if response.HasField("output"):
        return (part(response.output, "output"),)
    loss = (torch.tensor([response.loss]),)
    return loss + (part(response.input_grad, "input_grad"),) if response.HasField("input_grad") else loss
