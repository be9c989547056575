"""`swarm train --coordinator URL`: training through the swarm, found in the DHT.

Every few seconds the trainer reads each stage's online peers from the DHT and hands them to that
stage's `Router`. Each call goes to the peer the router expects to finish it first; a call that
fails or times out is retried on another peer of the same stage, and the failing peer is banned
with an exponential back-off until it answers again. When a stage has no live peer, the trainer
waits and says so on its progress line; it also pings the DHT nodes it knew (the coordinator's,
the peers' last announced ones), in case it is the trainer that lost touch with the DHT
(`records.Reconnector`). The trainer announces itself (steps, loss, tokens/s,
failed calls, bans, bytes on the wire).
The operator's word comes through the DHT too: peers the operator removed get no more calls, and
while the run is paused no new global step starts.
"""

from __future__ import annotations

import sys
import threading
import time
import uuid
from collections.abc import Callable, Collection
from typing import TypeVar

import grpc
import hivemind
import torch
from tqdm import tqdm

from swarm.client import StageClient, deadline
from swarm.config import RunConfig
from swarm.join import join_dht
from swarm.records import (
    REFRESH_S,
    ControlState,
    Reconnector,
    TrainerRecord,
    announce_trainer,
    maddr_peer_ids,
    read_control,
    read_removed,
    read_swarm,
    shutdown_dht,
)
from swarm.routing import Router
from swarm.rpc import pb
from swarm.train_pipeline import Pipeline, run_training
from swarm.verify import SpotChecks, tolerance
from swarm.wire import decode

T = TypeVar("T")

# Codes that say "this request is wrong", not "this peer is unwell": retrying elsewhere won't help.
REQUEST_FAULTS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED}

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


class SwarmPipeline(Pipeline):
    def __init__(
        self,
        run: RunConfig,
        initial_peers: list[str],
        dht: hivemind.DHT,
        call_timeout: float = 60.0,
        public_name: str = "",
        refresh_s: float = 2.0,
        join_token: str | None = None,
    ):
        """`run.verify`: how many forward calls are spot-checked (swarm/verify.py); `join_token`: the
        run's join token, sent with every call; `dht`: a client node of the run's DHT, joined through
        the coordinator at `initial_peers` (swarm.join.join_dht)."""
        self.run, self.num_stages = run, run.stages.count
        self.join_token = join_token
        v = run.verify
        self.spot = SpotChecks(self.num_stages, v.fraction, v.strikes, v.first_checks, run.training.seed, v.ban_s)
        self.call_timeout = call_timeout
        self.min_deadline = min(call_timeout, step_hold_s(run) + MIN_CALL_TIMEOUT_S)
        self.trace = uuid.uuid4().hex[:12]
        self.dht = dht
        self.coordinators = maddr_peer_ids(initial_peers)  # whose word on pauses and removals counts
        self.reconnector = Reconnector(self.dht, initial_peers)
        self.trainer = TrainerRecord(trainer_id=self.trace, public_name=public_name or f"trainer-{self.trace[:6]}")
        self.routers = [Router() for _ in range(self.num_stages)]
        self.addresses: list[dict[str, str]] = [{} for _ in range(self.num_stages)]
        self.clients: dict[str, StageClient] = {}
        self.lock = threading.Lock()
        self.failures = 0
        self.bans = 0  # failing peers banned (a peer that already left the routing is not banned)
        self.control = ControlState()
        self._stop = threading.Event()
        self.refresh()
        self._refresher = threading.Thread(target=self._refresh_loop, args=(refresh_s,), daemon=True)
        self._refresher.start()

    # -- membership --------------------------------------------------------------------------

    def refresh(self) -> None:
        for peer in self.spot.release():
            self.event(f"spot check: the ban of peer {peer} ended; its calls are checked until it passes again")
        view = read_swarm(self.dht, self.run.run_id, self.num_stages)
        if self.reconnector.check(view):  # a stage looks empty: maybe this node lost touch with the DHT
            view = read_swarm(self.dht, self.run.run_id, self.num_stages)
        removed = read_removed(self.dht, self.run.run_id, self.coordinators)  # by the operator: they are leaving
        control = read_control(self.dht, self.run.run_id, self.coordinators)
        now = time.monotonic()
        with self.lock:
            self.control = control
            for k in range(self.num_stages):
                online = [p for p in view.online(k) if p.peer_id not in removed and p.peer_id not in self.spot.banned]
                self.routers[k].update_peers({p.peer_id: p.throughput for p in online}, now)
                self.addresses[k] = {p.peer_id: p.address for p in online}

    def event(self, text: str) -> None:
        """Something the operator may want to know, on its own line above the progress bar."""
        tqdm.write(text, file=sys.stderr)

    def paused(self) -> bool:
        with self.lock:
            return self.control.paused

    def swarm_step(self) -> int:
        """The global step the stages are at: where a joining trainer starts."""
        view = read_swarm(self.dht, self.run.run_id, self.num_stages)
        steps = [max(p.optimizer_steps for p in view.online(k)) for k in range(self.num_stages) if view.online(k)]
        return min(steps, default=0)

    def _refresh_loop(self, period: float) -> None:
        last_announce = 0.0
        while not self._stop.wait(period):
            try:
                self.refresh()
                if time.monotonic() - last_announce >= REFRESH_S:
                    announce_trainer(self.dht, self.run.run_id, self.trainer)
                    last_announce = time.monotonic()
            except Exception as err:  # a DHT hiccup must not end training; the next round retries
                self.event(f"DHT read failed: {err!r}")

    def report(self, record: dict) -> None:
        self.trainer = self.trainer.model_copy(
            update={
                "samples": record["microbatches"] * self.run.training.micro_batch,
                "steps": record["step"] + 1,
                "loss": record["loss"],
                "val_loss": record.get("val_loss", self.trainer.val_loss),
                "tokens_per_s": record["tokens_per_s"],
                "failures": record["failures"],
                "bans": self.bans,
                "wire_bytes": record["wire_bytes"],
                "spot_checks": self.spot.checks,
                "spot_disagreements": self.spot.disagreements,
                "spot_bans": self.spot.bans,
                "spot_banned": dict(self.spot.banned),
            }
        )

    # -- calls -------------------------------------------------------------------------------

    def client(self, address: str) -> StageClient:
        with self.lock:
            if address not in self.clients:
                self.clients[address] = StageClient(
                    address, self.run, timeout=self.call_timeout, join_token=self.join_token
                )
            return self.clients[address]

    def call(
        self,
        stage: int,
        samples: int,
        fn: Callable[[StageClient], T],
        prefer: str | None = None,
        avoid: Collection[str] = (),
        timed: bool = True,
    ) -> tuple[T, str]:
        """`prefer`: try this peer first; `avoid`: these peers only when no other one is usable; `timed`:
        the call's time tells the peer's training speed (False for a spot check's evaluation forward)."""
        tried: set[str] = set()
        waited, rounds = False, 0
        while True:
            with self.lock:
                router, now = self.routers[stage], time.monotonic()
                peer = None
                if prefer and prefer not in tried and prefer in self.addresses[stage]:
                    others = set(router.peers) - {prefer}
                    peer = router.pick(samples, now, exclude=others)
                if peer is None and avoid:
                    peer = router.pick(samples, now, exclude=tried | set(avoid))
                if peer is None:
                    peer = router.pick(samples, now, exclude=tried)
                if peer is None:  # every live peer not tried yet is banned: ask the first to come back
                    peer = router.pick(samples, now, exclude=tried, banned_ok=True)
                address = self.addresses[stage].get(peer) if peer else None
                timeout = router.deadline(peer, self.min_deadline, self.call_timeout) if peer else 0.0
            if peer is None or address is None:
                if tried:  # every live peer failed once in this call: go round them again, at once at first
                    time.sleep(min(RETRY_PAUSE_S * rounds, WAIT_S))
                    tried.clear()
                    rounds += 1
                    continue
                self.note(f"waiting for a peer of stage {stage}")
                waited = True
                time.sleep(WAIT_S)
                continue
            if waited:
                self.note("train")
                waited = False
            start = time.monotonic()
            try:
                with deadline(timeout):
                    response = fn(self.client(address))
            except grpc.RpcError as err:
                if err.code() in REQUEST_FAULTS:
                    raise
                with self.lock:
                    if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                        router.answered(peer, timeout)  # slower than thought: give it longer next time
                    ban = router.failed(peer, samples, time.monotonic(), started=start)
                    self.failures += 1
                    if ban > 0:
                        self.bans += 1
                self.event(f"stage {stage} peer {peer[-8:]} failed ({err.code().name}); banned {ban:.0f} s")
                tried.add(peer)
                continue
            took = time.monotonic() - start
            elapsed = took - getattr(response, "queue_s", 0.0)
            with self.lock:
                router.answered(peer, took)
                if timed:
                    router.done(peer, samples, elapsed, time.monotonic())
                else:
                    router.returned(peer, samples, time.monotonic())
            return response, peer

    # -- spot checks (swarm/verify.py) -------------------------------------------------------

    def forward(
        self, stage: int, samples: int, name: str, train: bool, send: Callable[[StageClient, bool], pb.ForwardResponse]
    ) -> tuple[pb.ForwardResponse, str]:
        with self.lock:
            now = time.monotonic()
            peers = [p for p in self.addresses[stage] if not self.routers[stage].is_banned(p, now)]
        if not train or not self.spot.due(stage, name, peers):
            return super().forward(stage, samples, name, train, send)
        # The check goes first, as an evaluation forward (no gradient): on the last stage the
        # training forward completes the microbatch's gradient, the stage may step right after it,
        # and an evaluation sent then could see the next step's weights.
        check, checker = self.call(
            stage, samples, lambda c: send(c, False), prefer=self.spot.checker(stage, peers), timed=False
        )
        out, peer = self.call(stage, samples, lambda c: send(c, True), avoid={checker})
        if peer == checker:  # no other peer could answer: nothing to compare
            return out, peer
        last = stage == self.num_stages - 1
        rtol = self.run.verify.rtol or tolerance(self.run.wire.codec, self.run.model.dtype, encoded=not last)

        def arbiter() -> tuple[str, torch.Tensor] | None:
            others = [p for p in peers if p not in (peer, checker) and p not in self.spot.banned]
            if not others:
                return None
            third, who = self.call(
                stage,
                samples,
                lambda c: send(c, False),
                prefer=self.spot.checker(stage, others),
                avoid={peer, checker},
                timed=False,
            )
            return (who, self._answer(third, last)) if who not in (peer, checker) else None

        answers = [(peer, self._answer(out, last)), (checker, self._answer(check, last))]
        verdict = self.spot.judge(stage, answers, rtol, arbiter)
        if verdict.banned:
            with self.lock:
                self.routers[stage].remove(verdict.odd)
                self.addresses[stage].pop(verdict.odd, None)
            text = f"spot check: banned peer {verdict.odd} of stage {stage} at microbatch {name}"
            self.event(text)
        if verdict.odd == peer and not last:
            return check, checker  # pass the agreed hidden states on, not the outvoted ones
        return out, peer

    @staticmethod
    def _answer(response: pb.ForwardResponse, last: bool) -> torch.Tensor:
        """What a check compares: the hidden states, or on the last stage the microbatch's loss."""
        return torch.tensor([response.loss]) if last else decode(response.output, "output")

    def counts(self) -> dict:
        return {
            "spot_checks": self.spot.checks,
            "spot_disagreements": self.spot.disagreements,
            "spot_bans": self.spot.bans,
        }

    def bytes_on_wire(self) -> int:
        with self.lock:
            return sum(c.bytes_sent + c.bytes_received for c in self.clients.values())

    def close(self) -> None:
        self._stop.set()
        self._refresher.join(timeout=5)
        for c in list(self.clients.values()):
            c.close()
        # The last step's numbers, for the coordinator to show until the record expires.
        announce_trainer(self.dht, self.run.run_id, self.trainer, timeout=2)
        shutdown_dht(self.dht)


def train_swarm(
    coordinator: str,
    steps: int | None,
    inflight: int = 4,
    log_json=None,
    call_timeout: float = 60.0,
    public_name: str = "",
    data: str | None = None,
    verify_fraction: float | None = None,
    join_token: str | None = None,
    join_wait: float = 0.0,
) -> list[dict]:
    """Train through the run's swarm; `data`: text files (a file or a folder) to train on instead of
    the run's own data section (the run's model, schedule and batches stay the coordinator's);
    `verify_fraction`: the share of forward calls spot-checked, instead of the run's `verify.fraction`;
    `join_token`: the run's join token (for the coordinator and every stage worker); `join_wait`:
    seconds to keep trying a coordinator that does not answer."""
    run, initial_peers, dht = join_dht(coordinator, join_token, join_wait, client_mode=True)
    if data:
        run = run.with_data(data)
    if verify_fraction is not None:
        run = run.model_copy(update={"verify": run.verify.model_copy(update={"fraction": verify_fraction})})
    pipe = SwarmPipeline(
        run, initial_peers, dht, call_timeout=call_timeout, public_name=public_name, join_token=join_token
    )
    steps = steps or run.training.steps
    start = pipe.swarm_step()
    desc = f"train ({run.stages.count} stages via {coordinator}, {inflight} in flight)"
    if start:
        desc += f" from step {start}"
    return run_training(run, pipe, steps, inflight, log_json, desc, on_step=pipe.report, start=start)
