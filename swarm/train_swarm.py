"""`swarm train --coordinator URL`: training through the swarm, found in the DHT.

Every few seconds the trainer reads each stage's online peers from the DHT and hands them to that
stage's `Router`. Each call goes to the peer the router expects to finish it first; a call that
fails or times out is retried on another peer of the same stage, and the failing peer is banned
with an exponential back-off until it answers again. When a stage has no live peer, the trainer
waits and says so on its progress line. The trainer announces itself (steps, loss, tokens/s,
failed calls, bans, bytes on the wire).
The operator's word comes through the DHT too: peers the operator removed get no more calls, and
while the run is paused no new global step starts.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import TypeVar

import grpc

from swarm.client import StageClient
from swarm.config import RunConfig
from swarm.join import fetch_join
from swarm.records import (
    REFRESH_S,
    ControlState,
    TrainerRecord,
    announce_trainer,
    make_dht,
    read_control,
    read_removed,
    read_swarm,
    shutdown_dht,
)
from swarm.routing import Router
from swarm.train_pipeline import Pipeline, run_training

T = TypeVar("T")

# Codes that say "this request is wrong", not "this peer is unwell": retrying elsewhere won't help.
REQUEST_FAULTS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED}


class SwarmPipeline(Pipeline):
    def __init__(
        self,
        run: RunConfig,
        initial_peers: list[str],
        call_timeout: float = 60.0,
        public_name: str = "",
        refresh_s: float = 2.0,
    ):
        self.run, self.num_stages = run, run.stages.count
        self.call_timeout = call_timeout
        self.trace = uuid.uuid4().hex[:12]
        self.dht = make_dht(initial_peers, client_mode=True)
        self.trainer = TrainerRecord(trainer_id=self.trace, public_name=public_name or f"trainer-{self.trace[:6]}")
        self.routers = [Router() for _ in range(self.num_stages)]
        self.addresses: list[dict[str, str]] = [{} for _ in range(self.num_stages)]
        self.clients: dict[str, StageClient] = {}
        self.lock = threading.Lock()
        self.failures = 0
        self.bans = 0  # failing peers banned (a peer that already left the routing is not banned)
        self.events: list[str] = []
        self.control = ControlState()
        self._stop = threading.Event()
        self.refresh()
        self._refresher = threading.Thread(target=self._refresh_loop, args=(refresh_s,), daemon=True)
        self._refresher.start()

    # -- membership --------------------------------------------------------------------------

    def refresh(self) -> None:
        view = read_swarm(self.dht, self.run.run_id, self.num_stages)
        removed = read_removed(self.dht, self.run.run_id)  # by the operator: they are leaving
        control = read_control(self.dht, self.run.run_id)
        now = time.monotonic()
        with self.lock:
            self.control = control
            for k in range(self.num_stages):
                online = [p for p in view.online(k) if p.peer_id not in removed]
                self.routers[k].update_peers({p.peer_id: p.throughput for p in online}, now)
                self.addresses[k] = {p.peer_id: p.address for p in online}

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
                self.events.append(f"DHT read failed: {err}")

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
            }
        )

    # -- calls -------------------------------------------------------------------------------

    def client(self, address: str) -> StageClient:
        with self.lock:
            if address not in self.clients:
                self.clients[address] = StageClient(address, self.run, timeout=self.call_timeout)
            return self.clients[address]

    def call(
        self, stage: int, samples: int, fn: Callable[[StageClient], T], prefer: str | None = None
    ) -> tuple[T, str]:
        tried: set[str] = set()
        waited = False
        while True:
            with self.lock:
                router, now = self.routers[stage], time.monotonic()
                peer = None
                if prefer and prefer not in tried and prefer in self.addresses[stage]:
                    others = set(router.peers) - {prefer}
                    peer = router.pick(samples, now, exclude=others)
                if peer is None:
                    peer = router.pick(samples, now, exclude=tried)
                address = self.addresses[stage].get(peer) if peer else None
            if peer is None or address is None:
                if tried:  # every peer failed once: try them all again after the wait
                    tried.clear()
                self.note(f"waiting for a peer of stage {stage}")
                waited = True
                time.sleep(0.5)
                continue
            if waited:
                self.note("train")
                waited = False
            start = time.monotonic()
            try:
                response = fn(self.client(address))
            except grpc.RpcError as err:
                if err.code() in REQUEST_FAULTS:
                    raise
                with self.lock:
                    ban = router.failed(peer, samples, time.monotonic())
                    self.failures += 1
                    if ban > 0:
                        self.bans += 1
                self.events.append(f"stage {stage} peer {peer[-8:]} failed ({err.code().name}); banned {ban:.0f} s")
                tried.add(peer)
                continue
            elapsed = time.monotonic() - start - getattr(response, "queue_s", 0.0)
            with self.lock:
                router.done(peer, samples, elapsed, time.monotonic())
            return response, peer

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
) -> list[dict]:
    """Train through the run's swarm; `data`: text files (a file or a folder) to train on instead of
    the run's own data section (the run's model, schedule and batches stay the coordinator's)."""
    run, initial_peers = fetch_join(coordinator)
    if data:
        run = run.with_data(data)
    pipe = SwarmPipeline(run, initial_peers, call_timeout=call_timeout, public_name=public_name)
    steps = steps or run.training.steps
    start = pipe.swarm_step()
    desc = f"train ({run.stages.count} stages via {coordinator}, {inflight} in flight)"
    if start:
        desc += f" from step {start}"
    return run_training(run, pipe, steps, inflight, log_json, desc, on_step=pipe.report, start=start)
