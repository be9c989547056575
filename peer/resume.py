"""Where a stage's state comes from when a peer starts serving it (on joining, and after a move).

Checkpoints (peer/checkpoint.py): with a checkpoint folder, the worker saves its stage's state every
`checkpoint_every` steps in the background. When the peer starts serving a stage, its newest intact
checkpoint of that stage is loaded instead of the live peers' state when its step is above what most
online peers of the stage announce, or when there is no online peer; also when loading from the live
peers brings an older state than the checkpoint (the records were of peers that died since).
Otherwise the live peers' state wins, as without one.
"""

from __future__ import annotations

import logging

import torch

from peer.checkpoint import CheckpointError, CheckpointWriter, latest_checkpoint
from peer.options import PeerOptions
from peer.reach import Announcing
from peer.worker import StageWorker
from swarm.config import RunConfig
from swarm.records import read_stage
from swarm.steps import majority_step

log = logging.getLogger(__name__)


class StageLoader:
    """Makes a peer's stage workers and loads each with its stage's newest state: this peer's checkpoint
    when it is newer than what the live peers hold, else theirs (else the seeded init)."""

    def __init__(self, peer: Announcing, run: RunConfig, dht, device: torch.device, options: PeerOptions):
        self.peer, self.run, self.dht, self.device, self.options = peer, run, dht, device, options

    def new_worker(self, stage: int) -> StageWorker:
        """A worker of `stage` on this device, at the seeded init, saving checkpoints when the peer keeps them."""
        opts, checkpoints = self.options, None
        if opts.checkpoint_dir is not None:
            checkpoints = CheckpointWriter(opts.checkpoint_dir, self.run, stage, opts.checkpoint_every)
        return StageWorker(self.run, stage, self.device, self.dht, checkpoints, opts.faults, opts.inflight)

    def take_state(self, stage: int, worker: StageWorker) -> str:
        """Load the stage's newest state into `worker`: this peer's checkpoint when it is newer than
        what the live peers hold, else theirs (else the seeded init); returns where it came from."""
        self.options.faults.slow_download()
        folder = self.options.checkpoint_dir
        checkpoint = latest_checkpoint(folder, self.run, stage) if folder else None
        live = [] if checkpoint is None else self.live_steps(stage)
        source = None
        if checkpoint is None or (live and checkpoint.step <= majority_step(live)):
            source = worker.updater.load_state()
            if checkpoint is None or worker.optimizer_steps >= checkpoint.step:
                return source
            log.info(
                f"peer {self.peer.name}: the live peers of stage {stage} offered step {worker.optimizer_steps}, "
                f"the checkpoint holds step {checkpoint.step}"
            )
        try:
            source = worker.load_checkpoint(checkpoint)
        except CheckpointError as err:
            log.warning(f"peer {self.peer.name}: cannot load checkpoint {checkpoint.path}: {err}")
            return source if source is not None else worker.updater.load_state()
        log.info(f"peer {self.peer.name}: resumed stage {stage} from {checkpoint.path}")
        return source

    def live_steps(self, stage: int) -> list[int]:
        """The steps the other online peers of `stage` hold, as their records say."""
        records = read_stage(self.dht, self.run.run_id, stage)
        return [p.optimizer_steps for p in records if p.state == "online" and p.peer_id != self.peer.record.peer_id]
