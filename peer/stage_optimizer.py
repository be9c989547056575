"""The hivemind Optimizer of a stage's replicas: how it is made (`stage_optimizer`), the gradient
averager it makes (`grad_averager_factory`), and how it is stopped within a volunteer's patience
(`shut_down`)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from functools import partial

import hivemind
import torch

from peer.allreduce import COMPRESSIONS
from peer.hivemind_compat import CappedGradientAverager, CappedPowerSGDAverager
from swarm.config import AveragingConfig, RunConfig
from swarm.records import TTL_S


def stage_optimizer(
    run: RunConfig,
    dht: hivemind.DHT,
    prefix: str,
    params: tuple[list[dict], Callable, Callable | None],
    min_refresh_s: float,
) -> hivemind.Optimizer:
    """hivemind's Optimizer for the replicas of a stage under the run id `prefix`. `params`: the
    parameter groups it averages and holds, the optimizer it steps them with, and its learning-rate
    scheduler; `min_refresh_s`: how often, at most, its tracker fetches the stage's progress."""
    t, a = run.training, run.averaging
    groups, optimizer, scheduler = params
    return hivemind.Optimizer(
        dht=dht,
        # hivemind 1.1.12 inherits the DHT's client mode in its averagers but not in the Optimizer
        # itself (`client_mode if client_mode is None else dht.client_mode` keeps None), which then
        # offers the state a client-mode averager cannot share and fails every step: said here.
        client_mode=dht.client_mode,
        run_id=prefix,
        target_batch_size=t.global_batch,
        params=groups,
        optimizer=optimizer,
        scheduler=scheduler,
        matchmaking_time=a.matchmaking_time_s,
        averaging_timeout=a.averaging_timeout_s,
        next_chunk_timeout=a.chunk_timeout_s,
        load_state_timeout=a.load_state_timeout_s,
        shutdown_timeout=2,
        # The worker accumulates into .grad itself (scaled by loss_scale), so hivemind's own
        # accumulators would only be a second copy.
        reuse_grad_buffers=True,
        offload_optimizer=False,
        grad_compression=COMPRESSIONS[a.compression],
        grad_averager_factory=grad_averager_factory(run, groups),
        # Replicas apply identical steps, so averaging their parameters would change nothing; a
        # replica that missed a round loads the others' state instead (`behind`).
        average_state_every=2**31 - 1,
        averager_opts={"request_timeout": a.request_timeout_s},
        # Fetch the stage's progress often (the step waits for it), but not more than 4 times a
        # second: each fetch is a DHT lookup of every node, and at 10 a second the trackers of a
        # 2 x 2 swarm made a quarter of each DHT node's RPCs. diloco: up to 10 times a second near
        # the step's expected end (hivemind's tracker fetches by it): an inner step has no
        # all-reduce, so the fetch sets its pace (a 2 x 2 swarm on tiny.toml at 20 Mbit/s went
        # from 3,392-3,667 tokens/s to 4,460). A dead peer's report expires as fast as its
        # swarm record does.
        tracker_opts={
            "min_refresh_period": min_refresh_s,
            "max_refresh_period": 0.5,
            "default_refresh_period": 0.5,
            "metadata_expiration": TTL_S,
            # The node's key rather than hivemind's process-wide one: two replicas in one process
            # (tests) would otherwise write each other's progress report.
            "private_key": getattr(dht, "record_key", None),
        },
    )


def grad_averager_factory(run: RunConfig, groups: list[dict]) -> Callable[..., CappedGradientAverager]:
    """What hivemind's Optimizer makes its gradient averager with: the capped averager of the run's
    compression (peer/hivemind_compat.py), on shared float32 buffers for `groups`."""
    a = run.averaging
    return partial(
        CappedPowerSGDAverager if a.compression == "powersgd" else CappedGradientAverager,
        **({"averager_rank": a.rank} if a.compression == "powersgd" else {}),
        averaged_grads=_grad_buffers(groups),
        global_batch=run.training.global_batch,
        start_timeout=start_timeout(a),
    )


def _grad_buffers(groups: list[dict]) -> list[torch.Tensor]:
    """The all-reduce buffers, in float32, in shared memory (hivemind's averager runs in a process of
    its own). Every replica copies in the same average (peer/allreduce.py ExactAllReduceRunner): with
    hivemind's own all-reduce, each replica's own part plus a delta differed in the last bit, which
    AdamW's first steps (and any near-zero gradient) turn into a whole step of the learning rate in
    opposite directions, and the buffers had to be float64 (twice the bytes) to hide it."""
    return [torch.zeros(p.shape, dtype=torch.float32).share_memory_() for g in groups for p in g["params"]]


def start_timeout(a: AveragingConfig) -> float:
    """How long after its all-reduce began a replica waits for a member of its group to begin sending
    (ExactAllReduceRunner): one that got the group's start opens its streams at once (milliseconds on
    a LAN, a round trip over the internet, where the matchmaking time is seconds), but on 2 busy CPU
    cores a replica could take a second to get to it; never more than hivemind's chunk timeout."""
    return min(a.chunk_timeout_s, max(2.0, a.matchmaking_time_s))


def shut_down(opt: hivemind.Optimizer, timeout: float) -> None:
    """Say goodbye to the stage's peers and stop the averagers, in at most about `timeout` s.

    hivemind's `Optimizer.shutdown` first waits for a running all-reduce (up to
    `averaging_timeout`), then up to `shutdown_timeout` per averager: too long for a volunteer's
    Ctrl-C. It runs in a daemon thread here; an averager process still alive after `timeout` is
    killed (its partners lose its part of a round, which they detect and repair). When the DHT
    node is gone already (a signal to the whole process group, as Ctrl-C sends, also reaches
    it and its p2pd), there is nobody to say goodbye through: the tracker is stopped and the
    averagers are killed."""
    if opt.dht.is_alive():
        goodbye = threading.Thread(target=opt.shutdown, name="optimizer-shutdown", daemon=True)
        goodbye.start()
        goodbye.join(timeout)
    else:
        # its last report goes through the DHT's pipe, now closed
        with contextlib.suppress(OSError, EOFError):
            opt.tracker.shutdown(timeout=0.5)
    for averager in (opt.grad_averager, opt.state_averager):
        if averager is not None and averager.is_alive():
            averager.kill()
            averager.join(1)
