"""A stage served by one worker alone (`swarm train --peers`): it sees every sample, so it takes an
AdamW step every `global_batch` samples served, on its own gradient (`LocalUpdater`). A stage served
by a swarm of peers averages with them instead (peer/averaging.py `SwarmUpdater`)."""

from __future__ import annotations

import logging

import torch

from peer.checkpoint import Checkpoint
from swarm.config import RunConfig
from swarm.optim import make_optimizer, param_groups
from swarm.schedule import lr_at

log = logging.getLogger("swarm.averaging")


class LocalUpdater:
    """One worker per stage: it sees every sample, so it steps after each global batch."""

    missed = False  # a lone stage never misses a step

    def __init__(self, run: RunConfig, module: torch.nn.Module):
        self.run, self.module = run, module
        self.optimizer = make_optimizer(param_groups(module, run.training.weight_decay), run)
        self.epoch = 0
        self.source = "the seeded init"

    outer_optimizer = None

    @property
    def agreed_step(self) -> int:
        return self.epoch

    def agreed_weights(self) -> None:
        return None

    def served(self, pending: int) -> None:
        pass

    def ready(self, pending: int) -> bool:
        return pending >= self.run.training.global_batch

    def orphaned(self, pending: int) -> bool:
        return False

    def started(self, pending: int) -> bool:
        return pending > 0

    def behind(self, pending: int) -> bool:
        return False

    def settling(self) -> bool:
        return False

    def step(self, pending: int, force: bool = False) -> int:
        """Apply the accumulated gradient; returns how many samples it used."""
        t = self.run.training
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.epoch, t)
        used = min(pending, t.global_batch)
        self.optimizer.step()
        if self.optimizer.skipped:
            self.optimizer.skipped = 0
            log.warning("stage step %d: dropped a non-finite gradient of %d samples", self.epoch, used)
        self.optimizer.zero_grad(set_to_none=True)
        self.epoch += 1
        return used

    def skip_to(self, step: int) -> None:
        """Count the steps up to `step` as taken, applying nothing (their gradients are gone)."""
        self.epoch = max(self.epoch, step)

    def load_state(self) -> str:
        return self.source

    def load_checkpoint(self, checkpoint: Checkpoint) -> str:
        """Take weights, optimizer state and step from `checkpoint`; returns where the state came from."""
        snapshot = checkpoint.load()
        snapshot.apply(self.module, self.optimizer)
        self.epoch = snapshot.step
        self.source = f"checkpoint step {snapshot.step}"
        return self.source

    def close(self) -> None:
        pass
