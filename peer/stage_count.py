"""Where a stage's count of samples toward a replica's next step stands (`StageCount`)."""

from __future__ import annotations

import logging
import time

import hivemind

from peer.hivemind_compat import tracked_partners
from peer.norm_exchange import NormExchange
from peer.rounds import live_partners
from swarm.config import RunConfig
from swarm.receipts import credible_samples, most_declared
from swarm.records import read_progress

log = logging.getLogger("swarm.averaging")


class StageCount:
    """The samples the stage's replicas served toward this replica's step, as hivemind's tracker
    counts them, checked against the reports no honest replica makes; and whether what the count
    lacks died with the other replicas."""

    def __init__(self, opt: hivemind.Optimizer, run: RunConfig, stage: int, norms: NormExchange):
        self.opt, self.run, self.stage, self.norms = opt, run, stage, norms
        self.credible_at = (0.0, 0)  # when the stage's credible sample count was last read, and what it was
        self.orphaned_at = (0.0, -1, False)  # when `orphaned` last looked, at which step, and what it found
        self.liars: set[str] = set()  # peers whose progress reports claimed more than any replica holds

    @property
    def epoch(self) -> int:
        return self.opt.local_epoch

    def reached(self, progress, pending: int) -> bool:
        """The stage as a whole served the global batch, and hivemind sees the peers to average with;
        `progress`: the tracker's global progress."""
        return (
            progress.samples_accumulated >= self.run.training.global_batch
            # hivemind averages only when its tracker sees another peer; until this peer's own
            # report shows up in a fetch it may see just one, and would step alone.
            and (pending >= self.run.training.global_batch or progress.num_peers >= 2)
            # A report beyond what any replica holds counts for nothing; with no report beyond it, the
            # sum shows none (a look at the reports themselves is then saved).
            and (
                progress.samples_accumulated <= most_declared(self.run.training.global_batch)
                or self._credible(pending) >= self.run.training.global_batch
            )
        )

    def orphaned(self) -> bool:
        """The count falls short, and what it lacks died with the stage's other replicas: every other
        stage has published its gradient norm of this step (their part of the step's work is done: the
        first stage's backward is the step's last work), and the replicas hivemind's tracker still
        lists answer no ping. A replica killed after it answered its calls takes their gradients with
        it, and its last progress report may not count them: the count would not come until the
        stepper's sync timeout, while the other stages wait for this one's norm as long (a survivor of
        a 2 x 2 swarm stepped 11 s after the kill); and a survivor that served none of the step (the
        dead one served it all, and stepped) waited as long for a state nobody is left to give.
        Looked at most every 0.5 s; the pings only once the rest holds."""
        read_at, epoch, orphaned = self.orphaned_at
        if self.run.stages.count == 1:
            return False
        if epoch == self.epoch and time.monotonic() - read_at < 0.5:
            return orphaned
        others = set(range(self.run.stages.count)) - {self.stage}
        orphaned = set(self.norms.others(self.epoch)) >= others
        if orphaned:
            tracked = tracked_partners(self.opt)
            orphaned = bool(tracked) and not live_partners(self.opt, tracked)
        self.orphaned_at = (time.monotonic(), self.epoch, orphaned)
        return orphaned

    def _credible(self, pending: int) -> int:
        """The samples the stage holds toward this replica's step, leaving out the progress reports that
        no honest replica makes (swarm/receipts.py): one replica's report of 10^6 samples would
        otherwise fill every step's batch at once. Read from the DHT at most every 0.2 s."""
        read_at, total = self.credible_at
        if time.monotonic() - read_at > 0.2:
            me = self.opt.dht.peer_id.to_base58()
            reports = [r for r in read_progress(self.opt.dht, self.run.run_id, self.stage) if r[0] != me]
            total, liars = credible_samples(reports, self.epoch, self.run.training.global_batch)
            for peer in set(liars) - self.liars:
                log.warning(f"stage {self.stage}: ignoring peer {peer}'s reports of more samples than one step holds")
            self.liars.update(liars)
            self.credible_at = (time.monotonic(), total)
        return total + pending
