"""How a stage takes its optimizer steps: alone, or averaged with the other peers of its stage.

Both updaters work on the gradients the worker accumulates in the parameters' `.grad`: the last
stage scales each microbatch's loss by samples / global batch, so after a whole global batch the
sum of the served microbatches' gradients is the batch mean, as in the reference trainer.

`LocalUpdater` (a stage with one worker, e.g. `swarm train --peers`): an AdamW step every
`global_batch` samples served.

`SwarmUpdater` (a stage served by a swarm of peers): hivemind's `Optimizer`, one run id per stage
(`{run_id}_stage{k}`) with the run's global batch as its target batch size. Each peer reports the
samples it served through hivemind's progress tracker; when the stage as a whole has served the
global batch, every peer hands its gradient, weighted by the samples it served, to one all-reduce,
and every replica applies the same averaged gradient with the same AdamW state and learning rate:
the replicas stay identical. The step number is hivemind's epoch, and the learning-rate schedule
follows it. A peer that joins downloads the stage's weights, optimizer state and step from live
peers (`load_state`) before it serves.

With `[averaging] mode = "diloco"` (DiLoCo, Douillard et al. 2023, inside each stage) the replicas
average far less often: each applies its own gradient every step with an AdamW of its own (the inner
steps), and every `inner_steps` steps they average their pseudo-gradients, the outer weights minus
their inner ones, weighted by the samples each served in the phase; hivemind applies the outer step
(SGD with Nesterov momentum, swarm/optim.py `OuterNesterov`) to the outer weights, which it holds
and hands to joiners with the outer momentum, and every replica starts the next phase from them.
Between two outer steps the replicas' weights differ (the trainers check answers only in the first
step of a phase, swarm/trainer/spotcheck.py); the digests compare the outer weights.

What goes into the average is guarded: a peer whose gradient is not finite contributes no samples
(its gradient is dropped), each contribution is clipped (`clip_contribution`), and a step whose
averaged gradient is not finite is not applied (`ClippedAdamW` skips it).

Both updaters resume from a checkpoint (peer/checkpoint.py, `load_checkpoint`): weights, optimizer
state and step, the step becoming the updater's epoch.

hivemind decides the end of an epoch from its tracker, which may also fire early on an estimated
time of arrival. Here the end of a global batch is known exactly (the trainer starts the next step
only when the last one is complete), so a step is taken only on the sample count, or when the
trainer has moved on (a request for a later step) and the count still falls short after
`averaging.sync_timeout_s` — a peer that died took its share of samples with it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import hashlib
import logging
import math
import multiprocessing
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import InvalidStateError
from functools import partial

import hivemind
import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.control import AveragingStage
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.power_sgd_averager import AllReducePhases, PowerSGDGradientAverager
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import as_aiter, azip, enter_asynchronously

from peer.allreduce import COMPRESSIONS, ExactAllReduceRunner
from peer.checkpoint import Checkpoint
from swarm import norms
from swarm.config import AveragingConfig, RunConfig
from swarm.optim import make_optimizer, make_outer_optimizer, param_groups, primed
from swarm.receipts import capped_weight, credible_samples, most_declared, sample_caps
from swarm.records import (
    TTL_S,
    NormShare,
    WeightsDigest,
    answering,
    averaging_prefix,
    publish_digest,
    publish_norm_share,
    read_digests,
    read_norm_shares,
    read_progress,
    read_trainers,
    signed_progress,
    stage_members,
    stage_norms,
    state_holders_key,
)
from swarm.schedule import lr_at

log = logging.getLogger("swarm.averaging")

# Before each step the other replicas are pinged: one that does not answer in this time is not
# waited for in the all-reduce (a live one answers in milliseconds on a LAN, well under 1 s over the
# internet).
PING_TIMEOUT_S = 1.0

# The group key of a step's all-reduce carries the step, in this many bits (`step_bits`).
STEP_KEY_BITS = 24


def grads_finite(module: torch.nn.Module) -> bool:
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return True
    norms = torch._foreach_norm(grads)
    return bool(torch.isfinite(torch.stack(norms)).all())


def scale_grads(module: torch.nn.Module, factor: float) -> None:
    for p in module.parameters():
        if p.grad is not None:
            p.grad.mul_(factor)


def copy_weights(into, source) -> None:
    """Copy each parameter of `source` into the one of `into` at the same place."""
    with torch.no_grad():
        for dst, src in zip(into, source, strict=True):
            dst.copy_(src)


def drop_grads(module: torch.nn.Module) -> None:
    for p in module.parameters():
        if p.grad is not None:
            p.grad.zero_()


def clip_contribution(module: torch.nn.Module, max_norm: float) -> float:
    """Scale this peer's gradient down to norm `max_norm` when it is longer (`max_norm` 0: never);
    returns the factor applied (1.0 when left as it was).

    The stage's average is a weighted mean of its peers' gradients, so without a bound one peer's
    gradient a thousand times too long (a bug, a bad device, a bad actor) is the average, and the
    step then goes wherever it points. Clipping each contribution bounds its share of the average
    by its sample weight times `max_norm`.

    The bound is a multiple of `training.grad_clip` (`averaging.contribution_clip`, 10 by default)
    rather than `grad_clip` itself, because the step clips the averaged gradient again by the
    global norm: that final clip keeps the step's length, and this one only has to keep a single
    peer from taking over its direction. A bound at `grad_clip` would clip most honest gradients
    early in training (over one micro-batch of configs/tiny.toml a stage's gradient reaches 7x
    `grad_clip` in its first steps and about 10x in loss spikes), reweighting the samples away from
    the reference trainer's mean; at 10x an honest gradient is left alone nearly always."""
    if max_norm <= 0:
        return 1.0
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return 1.0
    norm = float(torch.stack(torch._foreach_norm(grads)).norm())
    if norm <= max_norm:
        return 1.0
    factor = max_norm / norm
    torch._foreach_mul_(grads, factor)
    return factor


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


def _grad_buffers(groups: list[dict]) -> list[torch.Tensor]:
    """The all-reduce buffers, in float32, in shared memory (hivemind's averager runs in a process of
    its own). Every replica copies in the same average (peer/allreduce.py ExactAllReduceRunner): with
    hivemind's own all-reduce, each replica's own part plus a delta differed in the last bit, which
    AdamW's first steps (and any near-zero gradient) turn into a whole step of the learning rate in
    opposite directions, and the buffers had to be float64 (twice the bytes) to hide it."""
    return [torch.zeros(p.shape, dtype=torch.float32).share_memory_() for g in groups for p in g["params"]]


def weights_digest(module: torch.nn.Module, sample: int = 65536) -> str:
    """A fingerprint of the weights' bits: up to `sample` evenly spaced elements of every tensor (a
    failed part of an all-reduce spans far more elements than the spacing)."""
    h = hashlib.blake2b(digest_size=16)
    with torch.no_grad():
        for p in module.parameters():
            flat = p.detach().reshape(-1)
            h.update(flat[:: max(1, flat.numel() // sample)].to("cpu").contiguous().numpy().tobytes())
    return h.hexdigest()


class CappedAverages:
    """For a hivemind gradient averager: every sender's weight in this replica's parts of the
    all-reduce capped by what the trainers saw it serve (swarm/receipts.py), not taken as declared.

    hivemind has no hook for the weights: each reducer adds a sender's part with the weight that
    sender sent along (`TensorPartReducer.accumulate_part`). `_run_allreduce_inplace_` below is
    hivemind 1.1.12's own, but for wrapping that call of the round's reducer, and for running
    ExactAllReduceRunner (every replica copies in the same average, also with a lossy codec). The caps live in the
    averager's process and come from the replica's through its control pipe (`cap`)."""

    def __init__(self, *args, global_batch: int, start_timeout: float | None = None, **kwargs):
        self.global_batch = global_batch
        self.start_timeout = start_timeout  # ExactAllReduceRunner: a member this late to begin is left out
        self.caps: dict[str, float] | None = None  # in the averager's process
        self.weight: float | None = None  # in the replica's process: overrides the samples accumulated
        # Bytes this replica reduced for the others in all rounds so far (ExactAllReduceRunner
        # reduced_bytes), counted in the averager's process, read in the replica's.
        self.reduced_bytes = multiprocessing.Value(ctypes.c_double, 0.0)
        # Nobody loads a gradient averager's state (`CappedGradientAverager.load_state_from_peers`), so
        # it does not offer one. Offered, hivemind re-announced the offer in the DHT on every tensor a
        # round averaged (its `_state_updated` wakes `_declare_for_download_periodically`): a 2 x 2
        # swarm of tiny.toml made 12 DHT stores a second for it, a third of its DHT nodes' RPCs.
        kwargs.setdefault("allow_state_sharing", False)
        super().__init__(*args, **kwargs)

    def step(self, weight: float | None = None, **kwargs):
        """hivemind's step, this replica weighing `self.weight` when set (diloco: a phase's samples)
        rather than the samples accumulated toward this one step."""
        return super().step(weight=self.weight if weight is None else weight, **kwargs)

    async def _step(self, *, step, future_for_init):
        """hivemind's step, but for a round cancelled (PartnerWatch) just as its all-reduce ended:
        hivemind 1.1.12 then sets the result of the cancelled control, which raises
        concurrent.futures' InvalidStateError where it catches only asyncio's; the task dies and its
        traceback lands in the peer's log. The round is over either way: the replica stepped with
        its own gradient, and the weights digests settle any difference."""
        try:
            await super()._step(step=step, future_for_init=future_for_init)
        except InvalidStateError:
            if not step.cancelled():
                raise
            log.info("a cancelled round's all-reduce ended after the cancel; its result is dropped")

    def cap(self, caps: dict[str, float] | None) -> None:
        """Cap the senders' weights in the rounds to come (peer id -> the most it may weigh)."""
        self._outer_pipe.send(("_set_caps", [caps], {}))

    async def _set_caps(self, caps: dict[str, float] | None) -> None:
        self.caps = caps

    def expect(self, size: int | None) -> None:
        """The next rounds' groups are complete at `size` averagers (None: only at the end of the
        matchmaking time). hivemind's leader starts the all-reduce as soon as its group reaches the
        target size, but the size is fixed when the averager is made; a stage knows its live replicas
        only at each step, and without a target every round waited out the whole matchmaking time."""
        self._outer_pipe.send(("_set_target_group_size", [size], {}))

    async def _set_target_group_size(self, size: int | None) -> None:
        self._matchmaking.target_group_size = size
        self._matchmaking.potential_leaders.target_group_size = size

    def for_step(self, step: int) -> None:
        """The next rounds are those of `step`: their group key names it (`step_bits`). Not waited for,
        as `cap` and `expect`: the averager takes its calls in order, so the key is set before the
        round's matchmaking begins."""
        self._outer_pipe.send(("_set_step_key", [step_bits(step)], {}))

    async def _set_step_key(self, bits: str) -> None:
        keys = self._matchmaking.group_key_manager
        keys.group_bits = bits
        # hivemind moves a key's bits on once a group assembles, each member by its own index, to
        # spread a large swarm's averagers over buckets (a stage's few replicas never need that): a
        # retry of the step's round after a failed all-reduce would look under a key of its own,
        # apart from its partners. The key stays the step's.
        keys.update_key_on_group_assembled = _keep_key

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        group_id = group_info.group_id if group_id is None else group_id
        runner = ExactAllReduceRunner(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            reduced_bytes=self.reduced_bytes,
            start_timeout=self.start_timeout,
            **kwargs,
        )
        senders = [p.to_base58() for p in runner.sender_peer_ids]
        reducer, caps = runner.tensor_part_reducer, self.caps
        accumulate = reducer.accumulate_part

        async def capped(sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0):
            allowed = capped_weight(caps, senders[sender_index], weight, self.global_batch)
            if allowed < weight and part_index == 0:
                log.warning(f"capped the weight of peer {senders[sender_index]} from {weight:g} to {allowed:g} samples")
            return await accumulate(sender_index, part_index, tensor_part, weight=allowed)

        reducer.accumulate_part = capped
        assert group_id in self._running_groups, f"Group id {group_id} was not registered in _register_allreduce_group"
        self._running_groups[group_id].set_result(runner)
        if runner.modes[group_info.peer_ids.index(self.peer_id)] != AveragingMode.AUX:
            async for tensor, averaged in azip(as_aiter(*tensors), runner):
                tensor.copy_(averaged)  # values, not differences (peer/allreduce.py); averaging_alpha is 1
                self.last_updated = get_dht_time()
                self._state_updated.set()
        else:
            async for _ in runner:
                raise ValueError("aux peers should not receive averaged tensors")


class CappedGradientAverager(CappedAverages, GradientAverager):
    """hivemind's gradient averager, its senders' weights capped (`CappedAverages`)."""

    def load_state_from_peers(self, wait: bool = True, timeout: float | None = None) -> None:
        """Nothing to take. hivemind's Optimizer, loading the stage's state, downloads a gradient
        averager's "state" (a peer's gradient buffers) after the optimizer's and then zeroes what it
        got (`reset_accumulated_grads_`): a whole gradient's bytes for nothing, and under load the
        download hung for the whole load_state_timeout (60 s) and kept a joining peer offline."""
        return None


class CappedPowerSGDAverager(CappedAverages, PowerSGDGradientAverager):
    """hivemind's PowerSGD averager (`[averaging] compression = "powersgd"`), its senders' weights capped.

    Each weight matrix M (this replica's gradient plus what earlier rounds left out: error feedback)
    travels as two factors of rank r: P = M Q, all-reduced and orthonormalised, then Q = M^T P,
    all-reduced; the average is P Q^T, and M - P Q^T stays for the next round. Vectors and matrices
    that r would not shrink by half go whole, in the Q round.

    `_aggregate_with_group` is hivemind 1.1.12's, but for the two things each replica computes on its
    own from the all-reduced factors, the orthonormal P and the product P Q^T: done in float64 and
    rounded to float32 once, so that replicas whose BLAS differ (a GPU's, another CPU's, another
    thread count) still end with the same bits, as the weights digests require; hivemind's float32
    arithmetic there differs in the last bits. Q starts from the same seeded values on every replica
    (hivemind draws it at random per replica), so that even the first round averages like factors."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        with torch.no_grad():
            for i, q in enumerate(self._qs):
                q.copy_(torch.rand(q.shape, generator=torch.Generator().manual_seed(i)))

    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs):
        try:
            bandwidths, mode_ids, user_gathered_bytes = zip(
                *map(self.serializer.loads, group_info.gathered), strict=True
            )
            user_gathered = dict(zip(group_info.peer_ids, map(self.serializer.loads, user_gathered_bytes), strict=True))
            modes = tuple(map(AveragingMode, mode_ids))
            download = [bw if mode != AveragingMode.CLIENT else 0.0 for bw, mode in zip(bandwidths, modes, strict=True)]
            fractions = await asyncio.get_event_loop().run_in_executor(
                None, load_balance_peers, self.total_size, download, min_vector_size
            )
            async with enter_asynchronously(self.get_tensors()) as averaged:
                whole = [g for i, g in enumerate(averaged) if i in self._uncompressed_gradients_indexes]
                factored = [g for i, g in enumerate(averaged) if i not in self._uncompressed_gradients_indexes]
                for g, m in zip(factored, self._ms, strict=True):
                    m.add_(g)
                ps = [m.reshape(-1, q.shape[0]) @ q for m, q in zip(self._ms, self._qs, strict=True)]
                await self._run_allreduce_inplace_(
                    ps,
                    group_info,
                    group_info.group_id + AllReducePhases.PHASE_P.name.encode(),
                    peer_fractions=fractions,
                    **kwargs,
                )
                bases = [orthonormal(p) for p in ps]
                for p, q, m in zip(bases, self._qs, self._ms, strict=True):
                    q.copy_(m.reshape(-1, q.shape[0]).t() @ p.float())
                await self._run_allreduce_inplace_(
                    [*self._qs, *whole],
                    group_info,
                    group_info.group_id + AllReducePhases.PHASE_Q.name.encode(),
                    peer_fractions=fractions,
                    **kwargs,
                )
                for p, q, m, g in zip(bases, self._qs, self._ms, factored, strict=True):
                    approx = (p @ q.double().t()).float().reshape(m.shape)
                    m.sub_(approx)
                    g.copy_(approx)
                return user_gathered
        except BaseException as e:
            log.exception(e)
            raise MatchmakingException(f"Unable to run All-Reduce: {e}") from e


def orthonormal(p: torch.Tensor) -> torch.Tensor:
    """The columns of `p` made orthonormal (Gram-Schmidt, as hivemind's orthogonalize_), in float64."""
    p = p.double()
    for i in range(p.shape[1]):
        col = p[:, i]
        col /= col.norm().clamp_min(1e-8)
        if i + 1 < p.shape[1]:
            rest = p[:, i + 1 :]
            rest -= col[:, None] * (col @ rest)[None, :]
    return p


class ReplicaCheck:
    """After every step (diloco: every outer step, the outer weights) and every load, each replica
    publishes a digest of its weights; a replica whose digest is not the one most replicas hold
    has diverged. Ties go to a digest that a replica offering the stage's state holds (`sources`:
    hivemind's state holders), then to the one whose holder has the smallest peer id: a replica
    behind a home router (client mode) offers no state, and when it alone held the winning digest,
    the other replica could load it from nobody and went on looking, several times a second.
    Only the digests of the stage's members count (`swarm.records.read_digests`): a DHT node that
    serves no stage cannot outvote the replicas and make them reload the stage's state every step.

    hivemind reports an all-reduce that lost some parts ("received 88% of results") only in its log,
    and the round still counts as a success; the replicas then differ in those parts."""

    WAIT_S = 5.0  # how long after its step a replica keeps looking for the others' digests

    def __init__(self, dht: hivemind.DHT, run_id: str, stage: int, sources: Callable[[], set[str]] = set):
        """`sources`: the peer ids (base58) of the replicas that offer the stage's state, read at a tie."""
        self.dht, self.run_id, self.stage, self.sources = dht, run_id, stage, sources
        self.me = dht.peer_id.to_base58()
        self.mine: tuple[int, str] | None = None
        self.settled = True  # nothing to check until the first step
        self.published_at = self.next_check = 0.0

    def publish(self, step: int, digest: str) -> None:
        self.mine = (step, digest)
        record = WeightsDigest(peer_id=self.me, stage=self.stage, step=step, digest=digest)
        publish_digest(self.dht, self.run_id, record)
        self.published_at = time.monotonic()
        self.next_check = self.published_at + 0.2
        self.settled = False

    def diverged(self, expected: int) -> bool:
        """True when this replica's weights differ from the stage's majority for its step. Looks at
        most every 0.5 s, until `expected` replicas have published or WAIT_S has passed."""
        if self.settled or self.mine is None or time.monotonic() < self.next_check:
            return False
        self.next_check = time.monotonic() + 0.5
        digests = read_digests(self.dht, self.run_id, self.stage, self.mine[0])
        if len(digests) >= expected or time.monotonic() - self.published_at > self.WAIT_S:
            self.settled = True
        if len(digests) < 2:
            return False
        holders = collections.Counter(digests.values())
        most = max(holders.values())
        tied = [d for d in holders if holders[d] == most]
        offered = {digests[p] for p in self.sources() if p in digests} if len(tied) > 1 else set()
        winner = min(tied, key=lambda d: (d not in offered, min(p for p, v in digests.items() if v == d)))
        return winner != self.mine[1]


class NormExchange:
    """The gradient norm over the whole model, from every stage's share.

    The reference trainer clips the norm of all parameters together; a stage sees only its own. At
    each step every replica of stage k publishes its averaged gradient's squared norm, pushed to the
    other stages' members and stored in the DHT (the replicas of a stage publish the same number;
    `swarm.records.stage_norms` takes the median of a stage's members' shares, and nobody else's),
    and waits for the other stages' shares, at most `timeout` seconds; then it falls back to its own
    norm."""

    SKIPPED_SHARES = 8  # a stage that skips steps publishes a share of 0 for at most this many of them
    MEMBERS_MAX_AGE_S = 2.0  # a stage's members are read again once the last read is this old
    DHT_READ_AFTER_S = 0.5  # the pushed shares come first; the DHT's records are read after this, and as often

    def __init__(
        self,
        dht: hivemind.DHT,
        run_id: str,
        stages: int,
        stage: int,
        timeout: float,
        idle: Callable[[], None] | None = None,
    ):
        """`idle`: called between looks at the DHT while waiting (default: a 20 ms sleep)."""
        self.dht, self.run_id, self.stages, self.stage = dht, run_id, stages, stage
        self.timeout, self.idle = timeout, idle or (lambda: time.sleep(0.02))
        self.me = dht.peer_id.to_base58()
        self.step = 0  # the global step being taken, set by the updater before each step
        self.waited = 0.0
        self.members_read: dict[int, tuple[float, set[str]]] = {}  # stage -> (when read, its peer ids)
        if stages > 1:
            norms.serve(dht)

    def publish(self, step: int, squared: float) -> None:
        """This stage's share of global step `step` (0.0 for a step it skipped): pushed straight to the
        other stages' members (swarm/norms.py), and stored in the DHT for any the push does not reach,
        without waiting for the DHT to confirm (a confirmed store took about 1 s on a loaded 2-core
        machine)."""
        if self.stages > 1:
            share = NormShare(peer_id=self.me, stage=self.stage, step=step, squared=squared)
            publish_norm_share(self.dht, self.run_id, share, timeout=0)
            others = [m for k in range(self.stages) if k != self.stage for m in self.members(k)]
            norms.push(self.dht, self.run_id, share, others)

    def members(self, stage: int) -> set[str]:
        """The peer ids of `stage`, read again once the last read is MEMBERS_MAX_AGE_S old: a step's
        polls would otherwise read every stage's records on every look at the shares."""
        read_at, members = self.members_read.get(stage, (-math.inf, set()))
        if time.monotonic() - read_at > self.MEMBERS_MAX_AGE_S:
            members = stage_members(self.dht, self.run_id, stage)
            self.members_read[stage] = (time.monotonic(), members)
        return members

    def others(self, step: int, stored: Sequence[NormShare] = ()) -> dict[int, float]:
        """The other stages' shares of `step` this node has (stage -> squared norm): those pushed to it,
        and `stored` (read from the DHT). Each stage's share is the median of its members' (one share
        per sender: a pushed one and its DHT record say the same)."""
        found = {s.peer_id: s for s in [*stored, *norms.received(self.dht, self.run_id, step)]}
        wanted = {s.stage for s in found.values() if s.stage < self.stages} - {self.stage}
        return stage_norms(list(found.values()), step, {k: self.members(k) for k in wanted})

    def __call__(self, squared: float) -> float:
        if self.stages == 1:
            return math.sqrt(squared)
        self.publish(self.step, squared)
        t0 = time.monotonic()
        deadline = t0 + self.timeout
        stored, stored_at = [], t0  # the DHT's records are read first after DHT_READ_AFTER_S
        while True:
            if time.monotonic() - stored_at > self.DHT_READ_AFTER_S:
                stored, stored_at = read_norm_shares(self.dht, self.run_id, self.step), time.monotonic()
            shares = self.others(self.step, stored)
            # This stage's own share is the one just computed: the replicas of a stage average the same
            # gradient, so the stage's median is this number (and a lying member cannot move it here).
            shares[self.stage] = squared
            self.waited = time.monotonic() - t0  # logged with the step
            if len(shares) == self.stages:
                return math.sqrt(sum(shares.values()))
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.stages)) - set(shares))
                log.warning(f"stage {self.stage} step {self.step}: no gradient norm from stage(s) {missing}; own norm")
                return math.sqrt(squared)
            self.idle()


class PartnerWatch:
    """While a step's all-reduce runs, pings the replicas it averages with every WATCH_PERIOD_S and
    cancels the round (hivemind then applies this replica's own gradient) once none answers, or once
    it has run longer than `stall_s`. A replica that dies in the middle of a round otherwise holds the
    others until averaging_timeout_s, and hivemind may start a round with a dead replica that its
    tracker still lists; a round can also stall with every partner alive (matchmaking around a replica
    that just joined). A replica that steps after a cancelled round may disagree with the others: the
    weights digests settle it (ReplicaCheck).

    A step that began with no partner is left alone: SwarmUpdater tells hivemind's tracker so, and
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


def start_timeout(a: AveragingConfig) -> float:
    """How long after its all-reduce began a replica waits for a member of its group to begin sending
    (ExactAllReduceRunner): one that got the group's start opens its streams at once (milliseconds on
    a LAN, a round trip over the internet, where the matchmaking time is seconds), but on 2 busy CPU
    cores a replica could take a second to get to it; never more than hivemind's chunk timeout."""
    return min(a.chunk_timeout_s, max(2.0, a.matchmaking_time_s))


def step_bits(step: int) -> str:
    """The group bits of the all-reduce that takes a stage from `step` to the next. hivemind's
    matchmaking groups the averagers whose keys match, and its key (the prefix and these bits) says
    nothing of the step on its own; its Optimizer lets a replica one step behind the stage step, so a
    replica still in the round of step k (it saw the stage's batch complete just as the others left
    that round) joined their round of step k + 1: it applied their gradient of step k + 1 to its
    weights of step k and missed theirs of step k, and the replicas drifted apart until the digests
    caught it (a 2 x 2 swarm on 2 loaded CPU cores, its stage-1 replicas one step apart three times
    in six steps). With the step in the key, a round only ever averages replicas at one step."""
    return format(step % 2**STEP_KEY_BITS, f"0{STEP_KEY_BITS}b")


async def _keep_key(group_info) -> None:
    """A group key manager's `update_key_on_group_assembled` that keeps the key (`_set_step_key`)."""


def _reporter(item) -> bytes | None:
    """The peer id in one entry of hivemind's progress key (None when it has none)."""
    report = getattr(item, "value", None)
    peer = report.get("peer_id") if isinstance(report, dict) else None
    return peer if isinstance(peer, bytes) else None


def tracked_partners(opt: hivemind.Optimizer) -> dict[bytes, dict]:
    """The other replicas of the stage that hivemind's tracker lists (peer id -> its last progress
    report): those an all-reduce would look for, the dead among them until their reports expire."""
    found = opt.dht.get(opt.tracker.training_progress_key, latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    me, partners = opt.dht.peer_id.to_bytes(), {}
    for item in found.value.values():
        if (peer := _reporter(item)) is not None and peer != me:
            partners[peer] = item.value
    return partners


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


def spent_round(opt: hivemind.Optimizer):
    """The optimizer's scheduled round, if a step already used it (triggered or finished); None when
    there is none, or when it is still waiting for a step. hivemind's step uses a round scheduled
    ahead of it (by an earlier try of the same step, whose tracker was not ready yet) and keeps the
    same object: such a round is this step's, not an earlier one's."""
    control = opt.scheduled_grads
    return control if control is not None and (control.triggered or control.done()) else None


def group_size(opt: hivemind.Optimizer, spent) -> int:
    """How many peers the all-reduce of the step just taken included (1: it averaged alone);
    `spent`: `spent_round` before the step. Comparing with any round scheduled before the step
    counted a round scheduled by an earlier try and used by this one as no round: a replica of a
    group of 2 said it averaged alone."""
    control = opt.scheduled_grads
    if control is None or control is spent or not control.done():
        return 1
    if control.cancelled() or control.exception() is not None:  # exception() raises on a cancelled one
        return 1
    return len(control.result())


def set_epoch(opt: hivemind.Optimizer, step: int) -> None:
    """Make `step` this replica's step without an all-reduce (the learning rate follows), tell the
    stage's tracker, and offer this replica's state with that priority: what hivemind's
    TrainingStateAverager.load_state_from_peers does after a download, through its private helpers
    (hivemind has no public way to move the epoch without a step)."""
    averager = opt.state_averager
    with averager.lock_averaged_tensors:
        averager.local_epoch = step
        averager._update_scheduler()
    opt.grad_averager.reset_accumulated_grads_()
    with opt.tracker.pause_updates():
        # As hivemind's own epoch transition: its check that this replica is in sync waits for a
        # fetch of the new epoch's progress rather than comparing with one of the last epoch's.
        opt.tracker.update_epoch(step)
    offer(averager, step)
    offer(opt.grad_averager, step)


def report_progress(opt: hivemind.Optimizer) -> None:
    """Store this replica's progress report (its step) in the DHT now, as hivemind's tracker does. The
    tracker stops storing the reports of a peer that served no samples in its last two steps (an
    auxiliary peer, to hivemind) and, once its last report expires, counts it out of the stage: the
    other replica's outer step then found no peer to average with and stepped alone, and this one,
    never ready, loaded its state, though it held a phase of inner steps (diloco: on 2 CPU cores a
    stage-0 replica that the trainer had stopped sending work missed every outer round). hivemind
    has no public way to store it: the key, the subkey and the report are its tracker's own."""
    tracker = opt.tracker
    opt.dht.store(
        tracker.training_progress_key,
        subkey=tracker._local_public_key,
        value=tracker.local_progress.dict(),
        expiration_time=get_dht_time() + tracker.metadata_expiration,
        return_future=True,
    )


def offer(averager: hivemind.DecentralizedAverager, priority: float) -> None:
    """Offer this replica's state to the stage's late joiners at `priority` (the highest is taken from).
    An averager in client mode (a peer behind a router: nobody can dial it) offers none."""
    if not averager.client_mode:
        averager.state_sharing_priority = priority


class SwarmUpdater:
    """The peers of one stage average gradients to a global batch through hivemind.Optimizer."""

    MAX_FAILED_LOADS = 3
    ROUND_HISTORY = 8  # the stall bound follows the median of this many last rounds with partners
    STALL_FACTOR = 5.0

    def __init__(
        self,
        run: RunConfig,
        stage: int,
        module: torch.nn.Module,
        dht: hivemind.DHT,
        idle: Callable[[], None] | None = None,
        declared: Callable[[int], int] = int,
    ):
        """`idle`: called again and again while a step waits for the other stages' gradient norms;
        `declared(samples)`: the count this replica tells the stage it holds (a test's liar lies)."""
        self.run, self.stage, self.module, self.declared = run, stage, module, declared
        self.credible_at = (0.0, 0)  # when the stage's credible sample count was last read, and what it was
        self.lagging_at = (0.0, False)  # diloco: when the partners' steps were last read, and whether one lags
        self.orphaned_at = (0.0, -1, False)  # when `orphaned` last looked, at which step, and what it found
        self.liars: set[str] = set()  # peers whose progress reports claimed more than any replica holds
        t, a = run.training, run.averaging
        self.prefix = averaging_prefix(run.run_id, stage)
        self.dropped = 0  # contributions left out of the average because they were not finite
        self.clipped = 0  # contributions clipped to `contribution_bound` before they were averaged
        self.contribution_bound = a.contribution_clip * t.grad_clip
        self.source = "the seeded init"
        self.missed = False  # the last all-reduce left this replica out
        self.lone = False  # the last round included no other replica, though some were live
        self.alone_at = 0.0  # when `settling` last looked for live partners
        self.failed_loads = 0  # loads in a row that brought nothing new while missed
        self.loaded_at: int | None = None  # the step of the last load of the stage's state
        self.check = ReplicaCheck(
            dht, run.run_id, stage, sources=lambda: {PeerID(p).to_base58() for p in self._state_holders()}
        )
        self.last_step: dict = {}
        self.rounds: collections.deque[float] = collections.deque(maxlen=self.ROUND_HISTORY)  # seconds, groups >= 2
        self.norms = NormExchange(dht, run.run_id, run.stages.count, stage, a.sync_timeout_s, idle)
        self.diloco = a.mode == "diloco"
        self.phase_samples = 0  # diloco: samples this replica stepped on since the last outer step
        self.inner_at: tuple[int, int] | None = None  # diloco: the step whose inner step is applied, its samples
        if self.diloco:
            # hivemind holds the outer weights, the ones the stage's replicas agree on, with the outer
            # momentum: it averages their pseudo-gradients and hands both to joiners. The module holds
            # this replica's inner weights, which its own AdamW steps on the microbatches it serves.
            self.inner_params = [p for p in module.parameters() if p.requires_grad]
            self.held: torch.nn.Module = torch.nn.ParameterList(
                [torch.nn.Parameter(p.detach().clone()) for p in self.inner_params]
            )
            self.inner: torch.optim.Optimizer | None = primed(make_optimizer(param_groups(module, t.weight_decay), run))
            groups = [{"params": list(self.held.parameters())}]
            optimizer, scheduler = partial(make_outer_optimizer, run=run), None
        else:
            self.held, self.inner = module, None
            groups = param_groups(module, t.weight_decay)
            optimizer = lambda groups: primed(make_optimizer(groups, run, global_norm=self.norms))  # noqa: E731
            # hivemind steps the scheduler once per epoch: the rate of global step e is lr_at(e).
            scheduler = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda e: lr_at(e, t) / t.lr)  # noqa: E731
        self.opt = hivemind.Optimizer(
            dht=dht,
            # hivemind 1.1.12 inherits the DHT's client mode in its averagers but not in the Optimizer
            # itself (`client_mode if client_mode is None else dht.client_mode` keeps None), which then
            # offers the state a client-mode averager cannot share and fails every step: said here.
            client_mode=dht.client_mode,
            run_id=self.prefix,
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
            grad_averager_factory=partial(
                CappedPowerSGDAverager if a.compression == "powersgd" else CappedGradientAverager,
                **({"averager_rank": a.rank} if a.compression == "powersgd" else {}),
                averaged_grads=_grad_buffers(groups),
                global_batch=t.global_batch,
                start_timeout=start_timeout(a),
            ),
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
                "min_refresh_period": 0.1 if self.diloco else 0.25,
                "max_refresh_period": 0.5,
                "default_refresh_period": 0.5,
                "metadata_expiration": TTL_S,
                # The node's key rather than hivemind's process-wide one: two replicas in one process
                # (tests) would otherwise write each other's progress report.
                "private_key": getattr(dht, "record_key", None),
            },
        )
        self.gone: set[bytes] = set()  # replicas that did not answer at the last step: not counted
        self.fetched: dict = {}  # what the tracker's last fetch found (parsed only when read: `reports`)
        parse = self.opt.tracker._parse_swarm_progress_data

        def without_gone(metadata):
            # hivemind has no way to leave a peer out of its tracker's count, nor to show the reports it
            # fetched; its parser is wrapped.
            self.fetched = metadata if isinstance(metadata, dict) else {}
            if isinstance(metadata, dict) and self.gone:
                metadata = {k: v for k, v in metadata.items() if _reporter(v) not in self.gone}
            return parse(metadata)

        self.opt.tracker._parse_swarm_progress_data = without_gone

    @property
    def epoch(self) -> int:
        return self.opt.local_epoch

    @property
    def reports(self) -> list[tuple[str, int, int]]:
        """(peer id, step, samples) of the progress reports in the tracker's last fetch that their
        replicas signed. Parsed here, not at each fetch (up to 10 a second): only an outer step reads them."""
        return signed_progress(self.fetched)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer of the module's weights (diloco: this replica's inner AdamW)."""
        return self.inner if self.inner is not None else self.opt.state_averager.optimizer

    @property
    def outer_optimizer(self) -> torch.optim.Optimizer | None:
        return self.opt.state_averager.optimizer if self.diloco else None

    @property
    def agreed_step(self) -> int:
        """The step the stage's agreed weights include: diloco, the last outer step's (within a phase
        the outer weights stay those of its first step)."""
        return self.epoch - self.epoch % self.run.averaging.inner_steps if self.diloco else self.epoch

    def agreed_weights(self) -> list[torch.Tensor] | None:
        """diloco: a copy of the outer weights (what the replicas agree on, what a joiner downloads);
        None otherwise (the module's weights are the stage's)."""
        if not self.diloco:
            return None
        with self.opt.state_averager.lock_averaged_tensors, torch.no_grad():
            return [p.detach().to("cpu", copy=True) for p in self.held.parameters()]

    def served(self, pending: int) -> None:
        """Tell the stage's tracker how many samples this peer holds gradients for."""
        self.opt.tracker.report_local_progress(self.epoch, self.declared(pending))

    def ready(self, pending: int) -> bool:
        """Time to take the step: the stage as a whole served the global batch (and hivemind sees the
        peers to average with), or the stage's other peers just took it and this peer holds samples."""
        progress = self.opt.tracker.global_progress
        if pending > 0 and progress.epoch == self.epoch + 1:
            return True
        counted = (
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
        # diloco, an outer step: the DHT reads and pings only once the count is there.
        outer = self.diloco and (self.epoch + 1) % self.run.averaging.inner_steps == 0
        return counted and not (outer and self._partner_lagging())

    def orphaned(self, pending: int) -> bool:
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

    def _partner_lagging(self) -> bool:
        """diloco, before an outer step: whether a live replica of the stage is still at an earlier step
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

    def behind(self, pending: int) -> bool:
        """This replica's weights are not the stage's: it missed a step (served nothing toward it, or
        was away), or its last all-reduce did not include the others. It must load their state: when
        the others are ahead, until it has; when only its weights differ, once per step (a load that
        brought nothing new, say while the others were still mid-step, waits for the next step
        rather than downloading the stage's state again and again)."""
        epoch = self.opt.tracker.global_epoch
        if epoch > self.epoch + 1 or (epoch == self.epoch + 1 and pending == 0):
            return True
        if self.loaded_at == self.epoch:
            return False
        if self.missed:
            return True
        if self.check.diverged(expected=max(2, self.opt.tracker.global_progress.num_peers)):
            self.missed = True
            offer(self.opt.state_averager, self.epoch - 0.5)  # load from the majority
            log.warning(f"stage {self.stage} step {self.epoch}: these weights differ from the other replicas'")
        return self.missed

    def settling(self) -> bool:
        """The last round included no other replica though some were live: until the replicas'
        digests say whether these weights are the stage's (`ReplicaCheck`, at most its WAIT_S after
        the step), work computed on them may be on weights nobody else holds. Once no other replica
        is live (`live_partners`: the partner died mid-round, its report not yet expired), none will
        publish a digest, and these weights are the stage's: waiting out WAIT_S stalled the trainer
        about 5 s after one peer of a 2 x 2 swarm was killed. Looked at most every 0.25 s."""
        if not self.lone or self.check.settled or self.loaded_at == self.epoch:
            return False
        if time.monotonic() - self.alone_at > 0.25:
            self.alone_at = time.monotonic()
            if not live_partners(self.opt):
                self.check.settled = True
                log.info(f"stage {self.stage} step {self.epoch}: no other replica is live; these weights stand")
                return False
        return True

    def started(self, pending: int) -> bool:
        """Some peer of the stage served samples toward the current step."""
        return pending > 0 or self.opt.tracker.global_progress.samples_accumulated > 0

    def step(self, pending: int, force: bool = False) -> int:
        """Hand this peer's gradient to the stage's all-reduce and apply the average; returns the
        samples used (0 when no step was taken).

        `force`: end the epoch even if the count falls short (the trainer has moved on).

        diloco: every step applies this replica's own gradient with its inner AdamW; the last step of
        each phase of `inner_steps` then averages the pseudo-gradients (outer minus inner weights)
        and takes the outer step, which every replica leaves with the same weights."""
        t, a = self.run.training, self.run.averaging
        if self.diloco:
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
        pending = self._finite(self.held, pending)
        scale = 1.0  # applied to .grad for the all-reduce; undone when no step is taken
        if pending > 0 and not self.diloco:
            # .grad holds (pending / global batch) x this peer's mean gradient; hivemind averages
            # contributions weighted by their samples, so hand it the mean, clipped.
            scale = t.global_batch / pending
            scale_grads(self.held, scale)
            clipped = clip_contribution(self.held, self.contribution_bound)
            if clipped < 1.0:
                scale *= clipped
                self.clipped += 1
                log.info("stage %d step %d: clipped this peer's gradient by %.3g", self.stage, self.epoch, clipped)
        if force and not self.ready(pending):
            # hivemind's tracker also ends an epoch when its estimated time of arrival has passed.
            with self.opt.tracker.pause_updates():
                self.opt.tracker.global_progress.eta_next_epoch = get_dht_time()
        tracked = tracked_partners(self.opt)
        partners = live_partners(self.opt, tracked)
        # hivemind counts a replica that died until its progress report expires (TTL_S) and looks for
        # a group with it until averaging_timeout_s: that stalled the whole pipeline right after one
        # peer of a 2 x 2 swarm was killed. Those that do not answer are left out of its view.
        self.gone = set(tracked) - set(partners)
        if not partners:
            # No other replica of the stage is there to average with: step alone at once. Said to the
            # tracker now, and to every fetch until the step begins (a fetch landing in between
            # brought the dead replica back and hivemind waited for it).
            with self.opt.tracker.pause_updates():
                self.opt.tracker.global_progress.num_peers = 1
        members = stage_members(self.opt.dht, self.run.run_id, self.stage)
        self.opt.grad_averager.cap(self._caps(members))
        self.opt.grad_averager.expect(self._group_target(partners, members))
        before, spent = self.epoch, spent_round(self.opt)
        reduced = self.opt.grad_averager.reduced_bytes.value
        self.norms.step = before
        started = time.perf_counter()
        self.opt.grad_averager.for_step(before)
        with PartnerWatch(self.opt, partners, before, self._stall_s()):
            self.opt.step(batch_size=self.declared(pending))
        if self.epoch != before + 1:
            # No step: the tracker's view changed between the check and the step (a fetch landed),
            # or hivemind found this peer out of sync and loaded the stage's state. Take back what
            # hivemind counted and the scaling, so that a next try counts these samples once.
            averager = self.opt.grad_averager
            averager.local_samples_accumulated = max(0, averager.local_samples_accumulated - self.declared(pending))
            averager.local_times_accumulated = max(0, averager.local_times_accumulated - 1)
            if scale != 1.0:
                scale_grads(self.held, 1.0 / scale)
            return 0
        if self.diloco:
            # The outer step is taken (or, group 0 below, not: then the stage's state is loaded):
            # the next phase starts from the outer weights.
            self._start_phase()
        group = group_size(self.opt, spent)
        optimizer = self.opt.state_averager.optimizer
        if optimizer.skipped:
            # The average came back non-finite (part of the all-reduce failed): the step was not
            # applied here, though others may have applied theirs.
            optimizer.skipped = 0
            group = 0
            log.warning(f"stage {self.stage} step {before}: the averaged gradient was not finite; not applied")
        self.last_step = {
            "step": before,
            "samples": pending,
            "group": group,
            "s": time.perf_counter() - started,
            "reduced_bytes": int(self.opt.grad_averager.reduced_bytes.value - reduced),
        }
        if group >= 2:
            self.rounds.append(self.last_step["s"] - self.norms.waited)
        log.info(
            "stage %d step %d: %d samples, averaged in a group of %d in %.3f s (norm wait %.3f s)",
            self.stage,
            before,
            pending,
            group,
            self.last_step["s"],
            self.norms.waited,
        )
        self.lone = group < 2 and bool(partners)
        if group == 0:
            # The others applied a step this replica did not: it must load their state.
            self.missed = True
            offer(self.opt.state_averager, self.epoch - 0.5)
            return pending
        if group < 2 and pending < t.global_batch:
            # A partial gradient: the round failed. The others may have averaged among themselves
            # (then this replica is the minority) or failed alike (each applied its own part: the
            # replicas now disagree evenly). The digests settle it either way: the majority, or on
            # a tie the smallest peer id, keeps its state and the rest load it.
            log.info(f"stage {self.stage} step {before}: averaged alone with {pending} samples")
        self.check.publish(self.epoch, weights_digest(self.held))
        return pending

    def _inner_step(self, pending: int) -> int:
        """diloco: apply this replica's gradient of the current step with its own AdamW, at the step's
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

    def _finite(self, module: torch.nn.Module, pending: int) -> int:
        """The samples `module`'s gradient counts for: `pending`, or 0 when it is not finite (then dropped)."""
        if grads_finite(module):
            return pending
        drop_grads(module)
        self.dropped += 1
        log.warning(f"stage {self.stage} step {self.epoch}: dropped a non-finite gradient of {pending} samples")
        return 0

    def _next_inner_step(self, pending: int) -> int:
        """diloco, within a phase: move on to the next step without an all-reduce."""
        before = self.epoch
        set_epoch(self.opt, before + 1)  # hivemind's tracker reports the new step when this replica served
        self.last_step = {"step": before, "samples": pending, "group": 1, "s": 0.0, "reduced_bytes": 0}
        log.info(
            "stage %d step %d: %d samples, inner step %d of %d",
            self.stage,
            before,
            pending,
            before % self.run.averaging.inner_steps + 1,
            self.run.averaging.inner_steps,
        )
        if pending == 0:
            self._announce_inner_step()
        return pending

    def _announce_inner_step(self) -> None:
        """diloco, after a step without an all-reduce that this replica served nothing of: its progress
        report (`report_progress`), with the step that `_partner_lagging` reads, which hivemind's
        tracker stops storing for a replica that serves nothing. No digest: within a phase the outer
        weights stay those of its first step, whose digest was published and checked then (a digest
        and its check at every inner step were two of each replica's five DHT operations a step)."""
        report_progress(self.opt)

    def _start_phase(self) -> None:
        """diloco: the inner weights become the outer ones (after an outer step or a load)."""
        copy_weights(self.inner_params, self.held.parameters())
        self.phase_samples, self.inner_at = 0, None

    def _stall_s(self) -> float | None:
        """The longest this step's all-reduce may run before this replica steps alone: STALL_FACTOR x
        the median of the last rounds with partners, at least one matchmaking plus one chunk timeout
        (hivemind itself leaves out a partner whose part is that late); None (up to hivemind's
        averaging_timeout_s) before three such rounds."""
        if len(self.rounds) < 3:
            return None
        a = self.run.averaging
        return max(self.STALL_FACTOR * statistics.median(self.rounds), a.matchmaking_time_s + a.chunk_timeout_s)

    def _caps(self, members: set[str]) -> dict[str, float] | None:
        """The most each replica of the stage (its `members`) may weigh in this step's all-reduce, from
        the trainers' receipts (swarm/receipts.py)."""
        key = str(self.stage)
        receipts = [t.served.get(key, {}) for t in read_trainers(self.opt.dht, self.run.run_id)]
        return sample_caps(receipts, members, self.run.training.global_batch)

    def _group_target(self, partners: dict[bytes, bool], members: set[str]) -> int | None:
        """The group size at which this step's round may start at once: every member of the stage, when
        each is a live partner (it reported samples toward the step and answers); else None, and the
        group gathers for the whole matchmaking time, as a replica the others do not count (say, one
        that served nothing this step, and steps with none) may still join. A group closed before
        such a replica joined left it looking for one until the stall bound (10 s)."""
        me = self.opt.dht.peer_id.to_base58()
        live = {PeerID(p).to_base58() for p in partners} | {me}
        return len(live) if members <= live else None

    def skip_to(self, step: int) -> None:
        """Count the steps up to `step` as taken, applying nothing: none of their samples reached a live
        peer of this stage. The learning rate follows the step; the other stages do not wait for this
        one's gradient norm (its share of the skipped steps is 0: it applies nothing)."""
        if step <= self.epoch:
            return
        if self.diloco and (self.epoch + 1) % self.run.averaging.inner_steps:
            # One of this phase's inner steps, not applied here (the others may have): ready for the next.
            self.inner_at = None
        # Only the last few: the other stages wait for the shares of the steps they are taking now.
        for skipped in range(max(self.epoch, step - NormExchange.SKIPPED_SHARES), step):
            self.norms.publish(skipped, 0.0)
        set_epoch(self.opt, step)
        self.check.publish(self.epoch, weights_digest(self.held))

    def load_state(self) -> str:
        """Take the stage's weights, optimizer state and step from live peers, if there are any;
        returns where the state came from."""
        if self.diloco and not self.missed and self.epoch < (ahead := self.opt.tracker.global_epoch):
            H = self.run.averaging.inner_steps
            if ahead // H == self.epoch // H:
                # Only inner steps in between: the outer weights are these; this replica keeps its
                # own inner progress and moves on to the stage's step.
                set_epoch(self.opt, ahead)
                self.inner_at = None
                self._announce_inner_step()
                return f"the stage's step {ahead} (same outer weights)"
        others = self._state_holders() - {self.opt.dht.peer_id.to_bytes()}
        digest = weights_digest(self.held)
        if others:
            self.opt.load_state_from_peers()
            if self.diloco:
                self._start_phase()
            self.loaded_at = self.epoch
            # At step 0 the stage's state is the seeded init, whoever handed it over.
            self.source = f"peers of stage {self.stage} at step {self.epoch}" if self.epoch else "the seeded init"
            if self.missed and weights_digest(self.held) == digest:
                # Nothing came (the others were still mid-step: hivemind refuses a state older than
                # its own): stay marked, and try again, a few times.
                self.failed_loads += 1
                if self.failed_loads < self.MAX_FAILED_LOADS:
                    return self.source
                log.info(f"stage {self.stage} step {self.epoch}: no peer offers a newer state; keeping this one")
        source = self.source
        if not others and self.missed:
            # Told its weights differ, with no other replica to load from (any others are behind home
            # routers): these weights stand until the next step; looking again at once found nobody again.
            self.loaded_at = self.epoch
            source = "these weights: no other replica offers the stage's state"
        self.missed, self.failed_loads = False, 0
        offer(self.opt.state_averager, self.epoch)
        self.check.publish(self.epoch, weights_digest(self.held))
        return source

    def load_checkpoint(self, checkpoint: Checkpoint) -> str:
        """Take weights, optimizer state and step from `checkpoint`, as hivemind's
        `load_state_from_peers` takes them from a peer: the checkpoint's step becomes the local epoch
        (and the learning rate's), the stage's tracker hears of it, and this replica offers its state
        with that priority, so replicas of the stage that are behind load it from here."""
        snapshot = checkpoint.load()
        averager = self.opt.state_averager
        with averager.lock_averaged_tensors:
            snapshot.apply(self.module, self.optimizer, self.outer_optimizer)
            if self.diloco:  # written at an outer step: its weights are the outer ones too
                copy_weights(self.held.parameters(), self.inner_params)
                self._start_phase()
        averager._load_local_tensors_into_averager_()  # as load_state_from_peers does after a download
        set_epoch(self.opt, snapshot.step)
        self.missed, self.failed_loads = False, 0
        self.source = f"checkpoint step {self.epoch}"
        self.check.publish(self.epoch, weights_digest(self.held))
        return self.source

    def _state_holders(self) -> set[bytes]:
        """Peers that offer this stage's state (hivemind's averagers announce themselves in the DHT)."""
        found = self.opt.dht.get(state_holders_key(self.prefix), latest=True)
        return set(found.value) if found is not None and isinstance(found.value, dict) else set()

    def close(self, timeout: float = 3.0) -> None:
        """Say goodbye to the stage's peers and stop the averagers, in at most about `timeout` s.

        hivemind's `Optimizer.shutdown` first waits for a running all-reduce (up to
        `averaging_timeout`), then up to `shutdown_timeout` per averager: too long for a volunteer's
        Ctrl-C. It runs in a daemon thread here; an averager process still alive after `timeout` is
        killed (its partners lose its part of a round, which they detect and repair). When the DHT
        node is gone already (a signal to the whole process group, as Ctrl-C sends, also reaches
        it and its p2pd), there is nobody to say goodbye through: the tracker is stopped and the
        averagers are killed."""
        if self.opt.dht.is_alive():
            goodbye = threading.Thread(target=self.opt.shutdown, name="optimizer-shutdown", daemon=True)
            goodbye.start()
            goodbye.join(timeout)
        else:
            # its last report goes through the DHT's pipe, now closed
            with contextlib.suppress(OSError, EOFError):
                self.opt.tracker.shutdown(timeout=0.5)
        for averager in (self.opt.grad_averager, self.opt.state_averager):
            if averager is not None and averager.is_alive():
                averager.kill()
                averager.join(1)
