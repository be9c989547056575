"""Every place a stage's updater reaches into hivemind (1.1.12) past its public API, in one room.

The subclasses of hivemind's gradient averagers and the private methods they override, and the
private state of its `Optimizer`, progress tracker and averagers that the updaters read or set
(peer/averaging.py, peer/gradients.py, peer/diloco.py). Each says why hivemind's own behaviour is
wrong for the replicas of a stage: a few replicas that must end every step with the same bits, a
step count that is the swarm's global step, and peers that die or sit behind home routers. The
all-reduce these averagers run, and its codecs, are peer/allreduce.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import multiprocessing
from concurrent.futures import InvalidStateError

import hivemind
import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.matchmaking import MatchmakingException, PotentialLeaders
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.power_sgd_averager import AllReducePhases, PowerSGDGradientAverager
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import as_aiter, azip, enter_asynchronously

from peer.allreduce import ExactAllReduceRunner
from swarm.receipts import capped_weight

log = logging.getLogger("swarm.averaging")

# The group key of a step's all-reduce carries the step, in this many bits (`step_bits`).
STEP_KEY_BITS = 24


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
        its own gradient, and the weights digests settle any difference. Its search for a group
        leader reads the DHT at most every `SpacedLeaders.SPACING_S`."""
        SpacedLeaders.adopt(self._matchmaking)
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
        # hivemind's matchmaking has no setter: its target is read from these two private objects.
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
        """hivemind 1.1.12's, but for the capped weights and ExactAllReduceRunner (the class's docstring)."""
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
        """hivemind 1.1.12's, but for P and P Q^T in float64 (the class's docstring)."""
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


class SpacedLeaders(PotentialLeaders):
    """hivemind's search for a group leader, reading the group's key from the DHT at most every
    SPACING_S. hivemind's reads it again as soon as a read finds no leader for this averager: the
    replica that reaches a step's matchmaking first (the group's leader, whom the others join) read
    the key back to back until the matchmaking ended, each read a round of RPCs to every DHT node
    near the key. In a 2 x 2 swarm of tiny.toml those reads were 365 of 1,250 DHT reads and writes
    in 16 steps. A member that arrives later still finds its leader on its first read; one whose
    first read raced the leader's declaration waits up to SPACING_S more."""

    SPACING_S = 0.25

    @classmethod
    def adopt(cls, matchmaking) -> None:
        """Make `matchmaking`'s search (made by hivemind's averager, in its process) a spaced one."""
        leaders = matchmaking.potential_leaders
        if type(leaders) is PotentialLeaders:
            leaders.__class__ = cls

    async def _update_queue_periodically(self, key_manager: GroupKeyManager) -> None:
        await super()._update_queue_periodically(_SpacedReads(key_manager, self.SPACING_S))


class _SpacedReads:
    """A group key manager whose `get_averagers` returns no sooner than `spacing` after the last began."""

    def __init__(self, keys: GroupKeyManager, spacing: float):
        self.keys, self.spacing, self.last = keys, spacing, -float("inf")

    @property
    def current_key(self):
        return self.keys.current_key

    async def get_averagers(self, *args, **kwargs):
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, self.last + self.spacing - loop.time()))
        self.last = loop.time()
        return await self.keys.get_averagers(*args, **kwargs)


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
    report): those an all-reduce would look for, the dead among them until their reports expire.
    hivemind shows only how many there are; they are read from its tracker's key in the DHT."""
    found = opt.dht.get(opt.tracker.training_progress_key, latest=True)
    return _partners(found.value if found is not None else None, opt.dht.peer_id.to_bytes())


def _partners(reports, me: bytes) -> dict[bytes, dict]:
    """The reports of the tracker's key (subkey -> an entry with its value), by the peer id of each
    replica but `me` that made one."""
    if not isinstance(reports, dict):
        return {}
    return {peer: item.value for item in reports.values() if (peer := _reporter(item)) is not None and peer != me}


class TrackerView:
    """hivemind's progress tracker, with some replicas left out of its count (`gone`), what its last
    fetch found (`fetched`, the raw reports: parsed only when read), and fetches spaced out while the
    stage is idle.

    hivemind counts a replica that died until its progress report expires (TTL_S) and looks for a
    group with it until averaging_timeout_s: that stalled the whole pipeline right after one peer of
    a 2 x 2 swarm was killed. It has no way to leave a peer out of its tracker's count, nor to show
    the reports it fetched; its parser (`_parse_swarm_progress_data`) is wrapped.

    Idle, the tracker still fetched every max_refresh_period (0.5 s, as the step waits for it while
    training), and a fetch of the latest progress asks every DHT node near the key: in an idle 2 x 2
    swarm, 60% of the DHT's requests. Once no replica has served toward the step for IDLE_AFTER_S, it
    fetches every IDLE_REFRESH_S, and a replica that serves samples fetches at once (`wake`)."""

    IDLE_AFTER_S = 3.0  # longer than a step's gap between two microbatches, so never while training
    IDLE_REFRESH_S = 2.0

    def __init__(self, tracker: ProgressTracker):
        self.tracker = tracker
        self.gone: set[bytes] = set()  # replicas that did not answer at the last step: not counted...
        self.gone_at = 0  # ... unless they report a later step than that one: they are alive and ahead
        self.fetched: dict = {}
        self.active_at = get_dht_time()  # the last fetch that saw samples toward the step, or a later step
        self._parse = tracker._parse_swarm_progress_data
        tracker._parse_swarm_progress_data = self._without_gone

    def wake(self) -> None:
        """This replica served samples: fetch the stage's progress now if the idle spacing delays it."""
        tracker, now = self.tracker, get_dht_time()
        self.active_at = now
        if tracker.global_progress.next_fetch_time <= now + tracker.max_refresh_period:
            return
        with tracker.lock_global_progress:  # not between a fetch's parse and its assignment
            tracker.global_progress.next_fetch_time = now
        tracker.global_state_updated.set()  # the fetcher's wait ends and it fetches

    def leave_out(self, gone: set[bytes], step: int) -> None:
        """Leave `gone` out of the count from the round of `step` on. A replica that only missed a ping
        (a loaded machine) and reports a later step counts again: left out for good, it hid the stage's
        step from a replica that follows the stage without serving, which then never caught up."""
        self.gone, self.gone_at = gone, step

    def partners(self, opt: hivemind.Optimizer) -> dict[bytes, dict]:
        """`tracked_partners` as of the tracker's last fetch (at most its max_refresh_period old, the
        fetch that told it the step is due), or read from the DHT before its first fetch: one DHT read
        less per step and replica."""
        if not self.fetched:
            return tracked_partners(opt)
        return _partners(self.fetched, opt.dht.peer_id.to_bytes())

    def _without_gone(self, metadata):
        self.fetched = metadata if isinstance(metadata, dict) else {}
        if isinstance(metadata, dict) and self.gone:
            metadata = {k: v for k, v in metadata.items() if _reporter(v) not in self.gone or self._ahead(v)}
        progress = self._parse(metadata)
        now, local = get_dht_time(), self.tracker.local_progress
        if progress.samples_accumulated or local.samples_accumulated or progress.epoch > local.epoch:
            self.active_at = now
        elif now - self.active_at > self.IDLE_AFTER_S:
            progress.next_fetch_time = max(progress.next_fetch_time, now + self.IDLE_REFRESH_S)
        return progress

    def _ahead(self, item) -> bool:
        epoch = item.value.get("epoch")
        return isinstance(epoch, int) and epoch > self.gone_at


def count_alone(tracker: ProgressTracker) -> None:
    """Tell the tracker that no other replica is there to average with, so that hivemind steps alone
    at once rather than look for a group (it has no public way to be told). Said to the tracker now,
    and to every fetch until the step begins (`TrackerView.gone`): a fetch landing in between
    brought the dead replica back and hivemind waited for it."""
    with tracker.pause_updates():
        tracker.global_progress.num_peers = 1


def end_epoch_now(tracker: ProgressTracker) -> None:
    """End the current epoch though its count falls short (the trainer has moved on): hivemind's
    tracker ends one only on the count or once its estimated time of arrival has passed, so the
    estimate is set to now."""
    with tracker.pause_updates():
        tracker.global_progress.eta_next_epoch = get_dht_time()


def drop_unbegun_round(opt: hivemind.Optimizer) -> None:
    """Cancel the optimizer's scheduled gradient round if it has not begun (its all-reduce not let
    through yet). hivemind's load_state_from_peers would tag along with it at zero weight and wait
    for it up to averaging_timeout_s: a replica that takes the stage's state has nothing to add to
    it, and a round that finds no group (a peer that moved into a stage scheduled one the others
    never joined) held that peer's calls for 100 s. A round already under way is left to finish."""
    control = opt.scheduled_grads
    if control is None or control.triggered or control.done():
        return
    with contextlib.suppress(InvalidStateError):  # it finished meanwhile
        control.cancel()
    opt.scheduled_grads = None


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


def uncount(opt: hivemind.Optimizer, samples: int) -> None:
    """Take back what hivemind's gradient averager counted toward a step that was not taken (the
    tracker's view changed between the check and the step, or hivemind found this replica out of
    sync and loaded the stage's state), so that a next try counts these samples once: hivemind
    keeps them counted for the next step."""
    averager = opt.grad_averager
    averager.local_samples_accumulated = max(0, averager.local_samples_accumulated - samples)
    averager.local_times_accumulated = max(0, averager.local_times_accumulated - 1)


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


def adopt_local_state(opt: hivemind.Optimizer, step: int) -> None:
    """The weights and optimizer state now in the module and optimizer become the averager's, at
    step `step` (a checkpoint's), as hivemind's `load_state_from_peers` does after a download
    through its private helper; hivemind has no public way to take a state from anywhere else."""
    opt.state_averager._load_local_tensors_into_averager_()
    set_epoch(opt, step)


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
