"""`swarm train --coordinator URL`: training through the swarm, found in the DHT.

Each call goes to the peer its stage's router (swarm/routing.py) expects to finish it first; a call
that fails or times out is retried on another peer of the same stage, and the failing peer is
banned with an exponential back-off until it answers again. When a stage has no live peer, the
trainer waits and says so on its progress line. Who serves each stage, the operator's word (pause,
removals) and this trainer's own record come from `Membership` (swarm/trainer/membership.py); spot
checks wrap the forward calls (swarm/trainer/spotcheck.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection

import grpc

from swarm.client import StageClient, deadline
from swarm.config import ConfigError, RunConfig
from swarm.data import shards
from swarm.identity import Member
from swarm.join import join_dht
from swarm.progress import RunLog
from swarm.routing import Lanes
from swarm.rpc import pb
from swarm.trainer.caller import REQUEST_FAULTS, BackwardSend, CallerClosed, Check, ForwardSend, RunFailed, T, event
from swarm.trainer.clients import IdleClients
from swarm.trainer.leases import CoordinatorShards
from swarm.trainer.loop import run_training
from swarm.trainer.membership import Membership
from swarm.trainer.options import TrainerOptions
from swarm.trainer.spotcheck import SpotCheckCaller
from swarm.verify import SpotChecks
from swarm.wire import WireError

# The shortest deadline a call gets, however fast its peer answered lately (Router.deadline; the longest
# is --call-timeout), on top of the longest a stage may hold a call while it takes its optimizer step
# (`step_hold_s`).
MIN_CALL_TIMEOUT_S = 1.0


def step_hold_s(run: RunConfig) -> float:
    """How long a healthy stage may hold a call while it steps: it looks for its replicas (matchmaking),
    then waits for the other stages' gradient norms. A deadline shorter than that cuts off calls of a
    live peer mid-step; each is then computed twice, and the microbatches of one step end up split
    between replicas that no longer meet to average them."""
    return run.averaging.matchmaking_time_s + run.averaging.sync_timeout_s


# A stage with no live peer is looked at again every WAIT_S. When each live peer of a stage failed once
# within one call, they are asked again at once, then after RETRY_PAUSE_S, 2 x RETRY_PAUSE_S ... up to
# WAIT_S, so that a peer listed in the DHT but gone (its record lives out its TTL) is not hammered.
WAIT_S = 0.5
RETRY_PAUSE_S = 0.05
# A peer's client (its channel) is closed once unused for this long beyond the longest call (clients.py).
CLIENT_IDLE_S = 30.0


class SwarmCaller:
    """A `StageCaller` over the peers `members` lists: routed, retried elsewhere, failing peers banned."""

    def __init__(
        self,
        run: RunConfig,
        members: Membership,
        note: Callable[[str], None],
        member: Member,
        call_timeout: float = 60.0,
    ):
        """`note`: a status line next to the progress bar; `member`: this trainer's run membership (calls
        go over mutual TLS with its certificate); `call_timeout`: the longest deadline of a call."""
        self.run, self.members, self.note, self.member = run, members, note, member
        self.trace = members.trainer_id
        self.call_timeout = call_timeout
        self.min_deadline = min(call_timeout, step_hold_s(run) + MIN_CALL_TIMEOUT_S)
        self.clients = IdleClients(self._new_client, self._close_client, call_timeout + CLIENT_IDLE_S)  # by id, address
        self._closed_bytes = 0  # on the wire through the clients closed since
        self._generation = member.generation  # of the certificate the clients were made with
        self._clients_lock = threading.Lock()
        self.failures = 0
        self.bans = 0  # failing peers banned (a peer that already left the routing is not banned)
        self.bad_answers = 0  # answers that failed their check: blamed on the peer, retried elsewhere
        self._closed = threading.Event()  # set by close(): calls in progress end
        self._called: dict[str, str] = {}  # peer id -> the address it was last called at (`direct`)
        # Pinned paths (DiLoCo): a microbatch goes on to the replica its previous stage's replica fed before.
        self.pinned = run.averaging.mode == "diloco" and run.averaging.paths == "pinned"
        self.lanes = Lanes()
        self._lanes_lock = threading.Lock()

    def client(self, peer: str, address: str) -> StageClient:
        """The client for `peer` at `address`: its channel checks that the server there is `peer`."""
        with self._clients_lock:
            if self._closed.is_set():
                raise CallerClosed(f"peer {peer}: the trainer stopped")
            if self._generation != self.member.generation:  # a renewed certificate: new channels with it
                self._generation = self.member.generation
                self.clients.clear()
            return self.clients.get((peer, address))

    def _new_client(self, key: tuple[str, str]) -> StageClient:
        peer, address = key
        return StageClient(address, self.run, timeout=self.call_timeout, member=self.member, peer_id=peer)

    def _close_client(self, client: StageClient) -> None:
        self._closed_bytes += client.bytes_sent + client.bytes_received
        client.close()

    def call(
        self,
        stage: int,
        samples: int,
        fn: Callable[[StageClient], T],
        prefer: str | None = None,
        avoid: Collection[str] = (),
        timed: bool = True,
        check: Check | None = None,
        strict: bool = False,
    ) -> tuple[T, str]:
        """`prefer`: try this peer first; `avoid`: these peers only when no other one is usable (`strict`:
        a peer the router has banned for a moment comes before them, as a spot check's third voter must
        be another machine than the two that voted, however slow it just was); `timed`:
        the call's time tells the peer's training speed (False for a spot check's evaluation forward);
        `check`: raises on an answer that cannot be used.

        Blame: a failed call, a timeout and an answer that fails `check` are the peer's fault: it is
        banned and the call goes to another peer of the stage. A refusal of the request as malformed
        (`REQUEST_FAULTS`) is the peer's fault too while other peers of the stage accept it (the
        trainer checked what it sends: the input it got from the stage before passed `check`), and
        the trainer's own once every live peer of the stage refused it: `RunFailed`."""
        tried: set[str] = set()
        refused: dict[str, str] = {}  # peer -> why it refused this request
        waited, rounds = False, 0
        while True:
            if self._closed.is_set():  # the trainer is stopping: no call outlives it
                raise CallerClosed(f"stage {stage}: the trainer stopped")
            with self.members.stage(stage) as (router, addresses):
                now = time.monotonic()
                peer = None
                if prefer and prefer not in tried and prefer in addresses:
                    others = set(router.peers) - {prefer}
                    peer = router.pick(samples, now, exclude=others)
                if peer is None and avoid:
                    peer = router.pick(samples, now, exclude=tried | set(avoid))
                    if peer is None and strict:
                        peer = router.pick(samples, now, exclude=tried | set(avoid), banned_ok=True)
                if peer is None:
                    peer = router.pick(samples, now, exclude=tried)
                if peer is None:  # every live peer not tried yet is banned: ask the first to come back
                    peer = router.pick(samples, now, exclude=tried, banned_ok=True)
                address = addresses.get(peer) if peer else None
                timeout = router.deadline(peer, self.min_deadline, self.call_timeout) if peer else 0.0
            if peer is None or address is None:
                if tried:  # every live peer failed once in this call: go round them again, at once at first
                    self._closed.wait(min(RETRY_PAUSE_S * rounds, WAIT_S))
                    tried.clear()
                    rounds += 1
                    continue
                self.note(f"waiting for a peer of stage {stage}")
                waited = True
                self._closed.wait(WAIT_S)
                continue
            if waited:
                self.note("train")
                waited = False
            start = time.monotonic()
            self._called[peer] = address
            try:
                with deadline(timeout):
                    response = fn(self.client(peer, address))
                if check is not None:
                    check(response)
            except (grpc.RpcError, WireError) as err:
                if isinstance(err, WireError):
                    why = f"bad answer: {err}"
                    self.bad_answers += 1
                else:
                    why = err.code().name
                    if err.code() in REQUEST_FAULTS:
                        refused[peer] = f"{why}: {err.details()}"
                with self.members.stage(stage) as (router, _):
                    if isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                        router.answered(peer, timeout)  # slower than thought: give it longer next time
                    ban = router.failed(peer, samples, time.monotonic(), started=start)
                    self.failures += 1  # under the membership's lock, which every stage shares
                    if ban > 0:
                        self.bans += 1
                    everyone_refused = refused and set(router.peers) <= set(refused)
                if everyone_refused:
                    raise RunFailed(
                        f"every peer of stage {stage} refused this trainer's request ({refused[peer]})"
                    ) from None
                event(f"stage {stage} peer {peer[-8:]} failed ({why}); banned {ban:.0f} s")
                # A bad answer is no accident (a live peer sent it): a strike, as when a spot check
                # outvotes the peer, and after `verify.strikes` of them no calls until the ban ends.
                if isinstance(err, WireError) and self.members.spot.strike(stage, peer):
                    self.members.drop(stage, peer)
                    event(f"bad answers: banned peer {peer} of stage {stage}")
                tried.add(peer)
                continue
            took = time.monotonic() - start
            elapsed = took - getattr(response, "queue_s", 0.0)
            with self.members.stage(stage) as (router, _):
                router.answered(peer, took)
                if timed:
                    router.done(peer, samples, elapsed, time.monotonic())
                else:
                    router.returned(peer, samples, time.monotonic())
            return response, peer

    def forward(
        self,
        stage: int,
        samples: int,
        name: str,
        train: bool,
        send: ForwardSend,
        check: Check | None = None,
        mb_id: str = "",
        after: str | None = None,
    ) -> tuple[pb.ForwardResponse, str]:
        if not self.pinned or after is None:
            return self.call(stage, samples, lambda c: send(c, train), check=check)
        with self.members.stage(stage - 1) as (_, addresses):
            previous = set(addresses)
        with self.members.stage(stage) as (_, addresses), self._lanes_lock:
            partner = self.lanes.partner(stage, after, previous, addresses)
            avoid = self.lanes.taken(stage) if partner is None else set()
        answer, peer = self.call(stage, samples, lambda c: send(c, train), prefer=partner, avoid=avoid, check=check)
        with self._lanes_lock:
            self.lanes.pin(stage, after, peer)
        return answer, peer

    def backward(
        self,
        stage: int,
        samples: int,
        name: str,
        send: BackwardSend,
        prefer: str | None = None,
        check: Check | None = None,
        mb_id: str = "",
    ) -> tuple[pb.BackwardResponse, str]:
        return self.call(stage, samples, lambda c: send(c, False), prefer=prefer, check=check)

    def direct(self, stage: int, peer: str, fn: Callable[[StageClient], T]) -> T:
        """`fn` against `peer` of `stage` itself, at the address it was last called at: no routing,
        no retry elsewhere, no ban when it fails (grpc.RpcError; LookupError: never called)."""
        address = self._called.get(peer)
        if address is None:
            raise LookupError(f"peer {peer} of stage {stage} was never called")
        with deadline(self.min_deadline):
            return fn(self.client(peer, address))

    def served(self, stage: int, peer: str, samples: int) -> None:
        self.members.receipts.add(stage, peer, samples)

    def ceiling(self) -> int | None:
        return self.members.swarm_step() + 1

    def host(self, stage: int, peer: str) -> str:
        return self.members.hosts(stage).get(peer, peer)

    def paused(self) -> bool:
        return self.members.paused()

    def bytes_on_wire(self) -> int:
        with self._clients_lock:
            return self._closed_bytes + sum(c.bytes_sent + c.bytes_received for c in self.clients.values())

    def counts(self) -> dict:
        return {"bad_answers": self.bad_answers}

    def close(self) -> None:
        """Ends every call in progress: its channel closes (an RPC in flight is cancelled) and a call
        waiting for a peer stops waiting (`CallerClosed`)."""
        self._closed.set()
        with self._clients_lock:
            clients = list(self.clients.values())
        for c in clients:
            c.close()


def train_swarm(coordinator: str, opts: TrainerOptions) -> list[dict]:
    """Train through the swarm of the run at `coordinator`; the per-step records. `opts.data`: text
    files to train on instead of the run's own data section (the run's model, schedule and batches
    stay the coordinator's); `opts.verify_fraction`: the share of forward calls spot-checked, instead
    of the run's `verify.fraction`. The trainer leases the run's shards from the coordinator, so that
    trainers of one run read disjoint shards; with `opts.data` (its own files), or from a coordinator
    that leases none, it reads every shard itself."""

    def refused(run: RunConfig) -> None:
        # The coordinator chooses the run, not what this machine reads and sends to stage-0 peers.
        paths = run.data.local_paths()
        if paths and not opts.data and not opts.allow_config_files:
            raise ConfigError(
                f"{coordinator}'s run config names local files for the data ({', '.join(paths)}): a trainer "
                "reads local files only from its own --data PATH, or with --allow-config-files"
            )
        fraction = run.verify.fraction if opts.verify_fraction is None else opts.verify_fraction
        if opts.delayed_updates and fraction > 0:
            raise ConfigError(
                f"--delayed-updates: spot checks (verify.fraction {fraction:g}) compare two replicas' answers "
                "computed on the weights of the step a call names, and with delayed updates a replica answers "
                "before or after its step: turn them off with --verify-fraction 0"
            )

    run, initial_peers, dht, member = join_dht(
        coordinator, "trainer", opts.join_token, opts.join_wait, check=refused, client_mode=True
    )
    if opts.data:
        run = run.with_data(opts.data)
    if opts.verify_fraction is not None:
        run = run.model_copy(update={"verify": run.verify.model_copy(update={"fraction": opts.verify_fraction})})
    v = run.verify
    spot = SpotChecks(run.stages.count, v.fraction, v.strikes, v.first_checks, v.ban_s)
    members = Membership(run, dht, initial_peers, spot, member=member)
    source = None
    try:
        if not opts.data and CoordinatorShards.offered(coordinator, opts.join_token):
            source = CoordinatorShards(coordinator, shards(run.data), members.trainer_id, opts.join_token)
        steps = opts.steps or run.training.steps
        start = members.swarm_step() if opts.faults.start_step is None else opts.faults.start_step
        desc = f"train ({run.stages.count} stages via {coordinator}, {opts.inflight} in flight)"
        if start:
            desc += f" from step {start}"
        progress = RunLog(steps, opts.log_json, desc=desc, log_windows=opts.log_windows)
        calls = SwarmCaller(run, members, progress.note, member, opts.call_timeout)
        caller = SpotCheckCaller(calls, members, spot)
        return run_training(
            run,
            caller,
            progress,
            steps,
            opts.inflight,
            start=start,
            on_step=lambda r: members.report(r, calls.bans),
            source=source,
            overlap=opts.delayed_updates,
        )
    finally:
        if source is not None:
            source.close()
        member.stop()
        members.close()
