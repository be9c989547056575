"""One step's all-reduce among the replicas of a stage (`StepRound`): the other replicas it averages
with, those alive now (`live_partners`), and a watch on them while the round runs (`PartnerWatch`)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import InvalidStateError

import hivemind
from hivemind.averaging.control import AveragingStage
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from peer.hivemind_compat import TrackerView, count_alone, group_size, spent_round, tracked_partners
from swarm.config import RunConfig
from swarm.receipts import sample_caps
from swarm.records import TTL_S, answering, read_trainers

log = logging.getLogger("swarm.averaging")

# Before each step the other replicas are pinged: one that does not answer in this time is not
# waited for in the all-reduce (a live one answers in milliseconds on a LAN, well under 1 s over the
# internet).
PING_TIMEOUT_S = 1.0


def live_partners(opt: hivemind.Optimizer, reports: dict[bytes, dict] | None = None) -> dict[bytes, bool]:
    """The replicas this one can average with now (peer id -> whether it is in client mode): those
    that answer a ping, and those behind a router (client mode: nobody can ping them, they dial the
    group's leader) while their progress report is fresh; these only when some replica can lead a
    group (one not in client mode). `reports`: `tracked_partners(opt)`, when the caller has read it."""
    reports = tracked_partners(opt) if reports is None else reports
    pingable = [p for p, r in reports.items() if not r.get("client_mode")]
    alive = dict.fromkeys(answering(opt.dht, pingable, timeout=PING_TIMEOUT_S), False)
    if alive or not opt.client_mode:
        now = get_dht_time()
        for p, r in reports.items():
            if r.get("client_mode") and now - float(r.get("time") or 0) <= TTL_S:
                alive[p] = True
    return alive


class PartnerWatch:
    """While a step's all-reduce runs, pings the replicas it averages with every WATCH_PERIOD_S and
    cancels the round (hivemind then applies this replica's own gradient) once none answers, or once
    it has run longer than `stall_s`. A replica that dies in the middle of a round otherwise holds the
    others until averaging_timeout_s, and hivemind may start a round with a dead replica that its
    tracker still lists; a round can also stall with every partner alive (matchmaking around a replica
    that just joined). A replica that steps after a cancelled round may disagree with the others: the
    weights digests settle it (ReplicaCheck).

    A step that began with no partner is left alone: `StepRound` tells hivemind's tracker so, and
    hivemind then begins no round and cancels its pre-scheduled one itself (a second cancel from this
    thread raced with it and raised inside hivemind's step)."""

    WATCH_PERIOD_S = 0.5

    def __init__(
        self,
        opt: hivemind.Optimizer,
        partners: dict[bytes, bool],
        step: int,
        stall_s: float | None = None,
    ):
        """`partners`: peer id -> whether it is in client mode (`live_partners`); `step`: the step the
        round is for (its group key: `step_bits`): a round still looking for a group ends once every
        partner has moved past it (nobody is left to join it); `stall_s`: the longest a round may run
        (None: up to hivemind's averaging_timeout_s)."""
        self.opt, self.partners, self.stall_s, self.step = opt, partners, stall_s, step
        self.pingable = [p for p, client in partners.items() if not client]
        self.cancelled: str | None = None  # why this watch cancelled the round, if it did
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="partner-watch", daemon=True)

    def __enter__(self) -> PartnerWatch:
        if self.partners:
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(PING_TIMEOUT_S + 1)

    def _watch(self) -> None:
        started, alone = time.monotonic(), False
        while not self.stop.wait(self.WATCH_PERIOD_S) and self.cancelled is None:
            if not alone:
                # Those behind a router cannot be pinged: a round with them ends by hivemind's timeout.
                answered = answering(self.opt.dht, self.pingable, timeout=PING_TIMEOUT_S)
                alone = not answered and (self.opt.client_mode or len(self.pingable) == len(self.partners))
            stalled = self.stall_s is not None and time.monotonic() - started > self.stall_s
            control = self.opt.scheduled_grads
            # Only a round that began: hivemind cancels one it did not begin itself.
            if control is None or not control.triggered or control.done():
                continue
            passed = not (alone or stalled) and self._passed(control)
            if not (alone or stalled or passed):
                continue
            if self.stop.is_set():
                return
            with contextlib.suppress(InvalidStateError):  # it finished meanwhile
                control.cancel()
            if alone:
                self.cancelled = "the replicas this step averages with stopped answering"
            elif passed:
                self.cancelled = f"the other replicas moved past step {self.step} before it found a group"
            else:
                self.cancelled = f"its all-reduce ran over {self.stall_s:.1f} s"
            log.warning(f"{self.cancelled}: this replica steps with its own gradient")

    def _passed(self, control) -> bool:
        """The round is still looking for a group and every partner reports a later step: no replica
        is left to join it (its key names this step), and it would wait out the stall bound."""
        if control.stage != AveragingStage.LOOKING_FOR_GROUP:
            return False
        reports = tracked_partners(self.opt)
        steps = [reports[p].get("epoch") for p in self.partners if p in reports]
        return len(steps) == len(self.partners) and all(isinstance(s, int) and s > self.step for s in steps)


class StepRound:
    """The all-reduce of one step: the replicas it waits for (`partners`), the most each may weigh, the
    group size at which it may start, and then how many replicas it gathered."""

    def __init__(self, opt: hivemind.Optimizer, run: RunConfig, stage: int, view: TrackerView, members: set[str]):
        """Sets the round up: `view` lists the replicas hivemind's tracker counts, and leaves those that do
        not answer out of its count; `members`: the peer ids with a record in the stage."""
        self.opt, self.run, self.stage = opt, run, stage
        tracked = view.partners(opt)
        self.partners = live_partners(opt, tracked)
        view.leave_out(set(tracked) - set(self.partners), opt.local_epoch)
        if not self.partners:
            # No other replica of the stage is there to average with: step alone at once.
            count_alone(opt.tracker)
        opt.grad_averager.cap(self._caps(members))
        opt.grad_averager.expect(self._group_target(members))
        self.step, self.spent = opt.local_epoch, spent_round(opt)
        self.reduced_before = opt.grad_averager.reduced_bytes.value
        self.started = time.perf_counter()

    def take(self, batch_size: int, stall_s: float | None) -> bool:
        """hivemind's step, this replica declaring `batch_size` samples, the round cancelled once its
        partners stop answering or it runs over `stall_s` (`PartnerWatch`); whether the step was taken."""
        self.opt.grad_averager.for_step(self.step)
        with PartnerWatch(self.opt, self.partners, self.step, stall_s):
            self.opt.step(batch_size=batch_size)
        return self.opt.local_epoch == self.step + 1

    def group(self) -> int:
        """How many replicas the round averaged (1: alone), or 0 when its average was not applied here."""
        group = group_size(self.opt, self.spent)
        optimizer = self.opt.state_averager.optimizer
        if optimizer.skipped:
            # The average came back non-finite (part of the all-reduce failed): the step was not
            # applied here, though others may have applied theirs.
            optimizer.skipped = 0
            group = 0
            log.warning(f"stage {self.stage} step {self.step}: the averaged gradient was not finite; not applied")
        return group

    def summary(self, samples: int, group: int) -> dict:
        """What the step took: its samples, the round's group and time, and the bytes reduced for others."""
        return {
            "step": self.step,
            "samples": samples,
            "group": group,
            "s": time.perf_counter() - self.started,
            "reduced_bytes": int(self.opt.grad_averager.reduced_bytes.value - self.reduced_before),
        }

    def _caps(self, members: set[str]) -> dict[str, float] | None:
        """The most each replica of the stage (its `members`) may weigh in this step's all-reduce, from
        the trainers' receipts (swarm/receipts.py)."""
        key = str(self.stage)
        receipts = [t.served.get(key, {}) for t in read_trainers(self.opt.dht, self.run.run_id)]
        return sample_caps(receipts, members, self.run.training.global_batch)

    def _group_target(self, members: set[str]) -> int | None:
        """The group size at which this step's round may start at once: every member of the stage, when
        each is a live partner (it reported samples toward the step and answers); else None, and the
        group gathers for the whole matchmaking time, as a replica the others do not count (say, one
        that served nothing this step, and steps with none) may still join. A group closed before
        such a replica joined left it looking for one until the stall bound (10 s)."""
        me = self.opt.dht.peer_id.to_base58()
        live = {PeerID(p).to_base58() for p in self.partners} | {me}
        return len(live) if members <= live else None
