"""How `swarm train` trains, built once from the command line (swarm/trainer/cli.py) and passed down as it is."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainerFaults:
    """Test-only behaviour of a trainer; the defaults are an honest one."""

    # A hostile trainer: names this global step in its requests, whatever step the stages are at (its
    # next steps count on from there), as if it had joined a swarm that announced it.
    start_step: int | None = None


@dataclass(frozen=True)
class TrainerOptions:
    """The flags of `swarm train` of the same names; where to train (--local, --peers, --coordinator)
    is chosen in the CLI, which hands these to the trainer it picked."""

    steps: int | None = None  # optimizer steps; None: the run's training.steps
    inflight: int = 4  # microbatches in flight at once
    delayed_updates: bool = False  # send a step's microbatches while the previous step's finish (loop.py `overlap`)
    log_json: str | None = None  # one JSON object per optimizer step to this file
    log_windows: str | None = None  # one JSON line per trained microbatch, naming its windows (tests, benchmarks)
    device: str | None = None  # --local: None for auto
    data: str | None = None  # text files to train on instead of the run's data section
    # --coordinator: read the local files the coordinator's run config names (else such a config is refused)
    allow_config_files: bool = False
    call_timeout: float = 60.0  # --coordinator: the longest a call waits before it is retried elsewhere
    verify_fraction: float | None = None  # --coordinator: share of forward calls spot-checked; None: the run's
    join_token: str | None = None  # the run's join token (the coordinator's, the stage workers')
    join_wait: float = 0.0  # --coordinator: seconds to keep trying a coordinator that does not answer
    faults: TrainerFaults = TrainerFaults()
