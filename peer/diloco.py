"""DiLoCo inside each stage (`[averaging] mode = "diloco"`, Douillard et al. 2023; `DiLoCoUpdater`).

The replicas average far less often than at every step: each applies its own gradient every step
with an AdamW of its own (the inner steps), and every `inner_steps` steps they average their
pseudo-gradients, the outer weights minus their inner ones, weighted by the samples each served in
the phase; hivemind applies the outer step (SGD with Nesterov momentum, swarm/optim.py
`OuterNesterov`) to the outer weights, which it holds and hands to joiners with the outer momentum,
and every replica starts the next phase from them. Between two outer steps the replicas' weights
differ (the trainers check answers only in the first step of a phase, swarm/trainer/spotcheck.py);
the digests compare the outer weights.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial

import torch
from hivemind.p2p import PeerID

from peer.averaging import SwarmUpdater
from peer.contribution import scale_grads
from peer.hivemind_compat import report_progress, set_epoch
from peer.rounds import PING_TIMEOUT_S
from swarm.optim import make_optimizer, make_outer_optimizer, param_groups, primed
from swarm.records import answering, signed_progress, stage_members
from swarm.schedule import lr_at

log = logging.getLogger("swarm.averaging")


def copy_weights(into, source) -> None:
    """Copy each parameter of `source` into the one of `into` at the same place."""
    with torch.no_grad():
        for dst, src in zip(into, source, strict=True):
            dst.copy_(src)


class DiLoCoUpdater(SwarmUpdater):
    """The peers of one stage take inner steps alone and average their pseudo-gradients every
    `inner_steps` steps, in an outer step, through hivemind.Optimizer."""

    MIN_REFRESH_S = 0.1  # an inner step has no all-reduce: the tracker's fetch sets its pace

    def _hivemind_params(self) -> tuple[list[dict], Callable, Callable | None]:
        # hivemind holds the outer weights, the ones the stage's replicas agree on, with the outer
        # momentum: it averages their pseudo-gradients and hands both to joiners. The module holds
        # this replica's inner weights, which its own AdamW steps on the microbatches it serves.
        self.inner_params = [p for p in self.module.parameters() if p.requires_grad]
        self.held = torch.nn.ParameterList([torch.nn.Parameter(p.detach().clone()) for p in self.inner_params])
        self.inner = primed(make_optimizer(param_groups(self.module, self.run.training.weight_decay), self.run))
        self.phase_samples = 0  # samples this replica stepped on since the last outer step
        self.inner_at: tuple[int, int] | None = None  # the step whose inner step is applied, its samples
        self.lagging_at = (0.0, False)  # when the partners' steps were last read, and whether one lags
        return [{"params": list(self.held.parameters())}], partial(make_outer_optimizer, run=self.run), None

    @property
    def reports(self) -> list[tuple[str, int, int]]:
        """(peer id, step, samples) of the progress reports in the tracker's last fetch that their
        replicas signed. Parsed here, not at each fetch (up to 10 a second): only an outer step reads them."""
        return signed_progress(self.tracker_view.fetched)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer of the module's weights: this replica's inner AdamW."""
        return self.inner

    @property
    def outer_optimizer(self) -> torch.optim.Optimizer:
        return self.opt.state_averager.optimizer

    @property
    def agreed_step(self) -> int:
        """The step the stage's agreed weights include: the last outer step's (within a phase the outer
        weights stay those of its first step)."""
        return self.epoch - self.epoch % self.run.averaging.inner_steps

    def agreed_weights(self) -> list[torch.Tensor]:
        """A copy of the outer weights (what the replicas agree on, what a joiner downloads)."""
        with self.opt.state_averager.lock_averaged_tensors, torch.no_grad():
            return [p.detach().to("cpu", copy=True) for p in self.held.parameters()]

    def _holds_step(self) -> bool:
        # An outer step: the DHT reads and pings only once the count is there.
        return (self.epoch + 1) % self.run.averaging.inner_steps == 0 and self._partner_lagging()

    def _partner_lagging(self) -> bool:
        """Before an outer step: whether a live replica of the stage is still at an earlier step
        of this phase (it served none of the last step's samples, and moves on once it sees the stage
        ahead: peer/stepper.py `maybe_step`). Its phase of inner steps belongs in the average: stepping
        at once, on the samples of the last step alone, averaged this replica alone and made the other
        load its state (on an H100 the stage-1 replicas of a 2 x 2 swarm averaged in 4 of 40 outer
        rounds, with H = 5). The replicas' steps are those of the progress reports that the stage's
        tracker fetched last, each signed by its replica; a replica that serves nothing reports its
        steps too (`_announce_inner_step`). Only members of the stage count (a DHT member that serves
        no stage cannot hold the outer step up), and a replica that lags further, or answers no ping,
        is not waited for; the stepper's deadline still steps once a trainer waits (`force`). Read at
        most every 0.25 s."""
        read_at, lagging = self.lagging_at
        if time.monotonic() - read_at > 0.25:
            H, me = self.run.averaging.inner_steps, self.opt.dht.peer_id.to_base58()
            late = {p for p, step, _ in self.reports if p != me and step < self.epoch and step // H == self.epoch // H}
            if late:
                late &= stage_members(self.opt.dht, self.run.run_id, self.stage)
            pings = [PeerID.from_base58(p).to_bytes() for p in late]
            lagging = bool(pings) and bool(answering(self.opt.dht, pings, timeout=PING_TIMEOUT_S))
            self.lagging_at = (time.monotonic(), lagging)
        return lagging

    def step(self, pending: int, force: bool = False) -> int:
        """Apply this replica's own gradient with its inner AdamW; the last step of each phase of
        `inner_steps` then hands the pseudo-gradient (outer minus inner weights) to the stage's
        all-reduce and takes the outer step, which every replica leaves with the same weights. Returns
        the samples used (0 when no step was taken). `force`: end the epoch even if the count falls
        short (the trainer has moved on)."""
        a = self.run.averaging
        pending = self._inner_step(pending)
        if (self.epoch + 1) % a.inner_steps:
            return self._next_inner_step(pending)
        with torch.no_grad():
            for outer, inner in zip(self.held.parameters(), self.inner_params, strict=True):
                outer.grad = outer.detach() - inner.detach()
        # Weighted by the samples it served per step of the phase (at least 1 in the phase: a
        # replica that served nothing hands over a zero pseudo-gradient): the scale of one step's
        # samples, which the trainers' receipts cap as in a step's gradient average.
        self.opt.grad_averager.weight = self.declared(max(1, self.phase_samples)) / a.inner_steps
        return self._average(self._finite(self.held, pending), force)

    def _inner_step(self, pending: int) -> int:
        """Apply this replica's gradient of the current step with its own AdamW, at the step's
        learning rate, once (a step tried again does not apply it twice); returns the samples used."""
        if self.inner_at is not None and self.inner_at[0] == self.epoch:
            return self.inner_at[1]
        t = self.run.training
        pending = self._finite(self.module, pending)
        if pending > 0:
            scale_grads(self.module, t.global_batch / pending)  # this replica's mean gradient
            for group in self.inner.param_groups:
                group["lr"] = lr_at(self.epoch, t)
            self.inner.step()
        self.module.zero_grad(set_to_none=False)
        self.inner_at = (self.epoch, pending)
        self.phase_samples += pending
        return pending

    def _next_inner_step(self, pending: int) -> int:
        """Within a phase: move on to the next step without an all-reduce."""
        before = self.epoch
        set_epoch(self.opt, before + 1)  # hivemind's tracker reports the new step if it saw samples of this one
        self.last_step = {"step": before, "samples": pending, "group": 1, "s": 0.0, "reduced_bytes": 0}
        log.info(
            "stage %d step %d: %d samples, inner step %d of %d",
            self.stage,
            before,
            pending,
            before % self.run.averaging.inner_steps + 1,
            self.run.averaging.inner_steps,
        )
        if pending == 0 or not self._samples_seen(before):
            self._announce_inner_step()
        return pending

    def _samples_seen(self, step: int) -> bool:
        """Whether the tracker's last fetch holds this replica's report of samples served toward `step`.
        hivemind's tracker goes on storing a replica's reports after a step only if one of them held
        samples of the step before; a replica that served its samples in one call and stepped before the
        tracker's reporter thread ran (a loaded machine) was taken for an auxiliary peer: its new step
        never reached the DHT, and a replica following the stage never saw the stage ahead."""
        me = self.opt.dht.peer_id.to_base58()
        return any(p == me and epoch == step and n > 0 for p, epoch, n in self.reports)

    def _announce_inner_step(self) -> None:
        """After a step without an all-reduce that hivemind's tracker may not report (this replica served
        nothing of it, or no report of its samples was seen, `_samples_seen`): its progress report
        (`report_progress`), with the step that `_partner_lagging` reads. No digest: within a phase
        the outer weights stay those of its first step, whose digest was published and checked then
        (a digest and its check at every inner step were two of each replica's five DHT operations a
        step)."""
        report_progress(self.opt)

    def _start_phase(self) -> None:
        """The inner weights become the outer ones (after an outer step or a load)."""
        copy_weights(self.inner_params, self.held.parameters())
        self.phase_samples, self.inner_at = 0, None

    def _held_changed(self) -> None:
        # The outer step is taken (or, group 0, not: then the stage's state is loaded), or the stage's
        # state loaded: the next phase starts from the outer weights.
        self._start_phase()

    def _checkpoint_applied(self) -> None:
        # Written at an outer step: its weights are the outer ones too.
        copy_weights(self.held.parameters(), self.inner_params)
        self._start_phase()

    def skip_to(self, step: int) -> None:
        if step > self.epoch and (self.epoch + 1) % self.run.averaging.inner_steps:
            # One of this phase's inner steps, not applied here (the others may have): ready for the next.
            self.inner_at = None
        super().skip_to(step)

    def load_state(self) -> str:
        if not self.missed and self.epoch < (ahead := self.opt.tracker.global_epoch):
            H = self.run.averaging.inner_steps
            if ahead // H == self.epoch // H:
                # Only inner steps in between: the outer weights are these; this replica keeps its
                # own inner progress and moves on to the stage's step.
                set_epoch(self.opt, ahead)
                self.inner_at = None
                self._announce_inner_step()
                return f"the stage's step {ahead} (same outer weights)"
        return super().load_state()
