"""The trainer: it owns the data and drives microbatches through the stages.

- `local`: the reference trainer, the whole model in one process (`swarm train --local`);
- `loop`: the training loop over any `StageCaller` (`caller`), reporting to a progress sink;
- `pipeline`: the static pipeline, one worker per stage (`swarm train --peers`);
- `swarm`: the swarm found in the DHT, calls routed and retried (`swarm train --coordinator`), with
  `membership` (who serves each stage, the operator's word) and `spotcheck` (checked forward calls);
- `options`: the options of `swarm train`, built once in the CLI;
- `cli`: the arguments of `swarm train`.

The names below are imported on first use, so that `swarm --help` (which imports `cli`) does not load
torch and hivemind.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from swarm.trainer.caller import StageCaller
    from swarm.trainer.local import train_local
    from swarm.trainer.loop import microbatch, run_training
    from swarm.trainer.membership import Membership
    from swarm.trainer.options import TrainerOptions
    from swarm.trainer.pipeline import StaticCaller, train_pipeline
    from swarm.trainer.spotcheck import SpotCheckCaller
    from swarm.trainer.swarm import SwarmCaller, step_hold_s, train_swarm

_HOMES = {
    "Membership": "membership",
    "SpotCheckCaller": "spotcheck",
    "StageCaller": "caller",
    "StaticCaller": "pipeline",
    "SwarmCaller": "swarm",
    "TrainerOptions": "options",
    "microbatch": "loop",
    "run_training": "loop",
    "step_hold_s": "swarm",
    "train_local": "local",
    "train_pipeline": "pipeline",
    "train_swarm": "swarm",
}
__all__ = [
    "Membership",
    "SpotCheckCaller",
    "StageCaller",
    "StaticCaller",
    "SwarmCaller",
    "TrainerOptions",
    "microbatch",
    "run_training",
    "step_hold_s",
    "train_local",
    "train_pipeline",
    "train_swarm",
]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"swarm.trainer.{_HOMES[name]}"), name)
