"""`swarm peer --coordinator URL`: a volunteer's daemon.

Join: fetch the run config and DHT addresses from the coordinator, join the DHT, pick a stage (the
one with the lowest total throughput, after a short random wait so that peers joining together
spread out), announce `joining`, measure this device's throughput (cached), download the stage's
weights, optimizer state and step from live peers of that stage through hivemind (else start from
the seeded init: the record's `weights_from` says which), start the stage worker, announce
`online` and keep refreshing the record.

When the peer starts serving a stage (on joining, and after a move), its newest checkpoint of that
stage is loaded instead of the live peers' state when it is newer (peer/resume.py). When the
coordinator cannot dial the peer back, it serves through a relay (peer/reach.py).

Leave (SIGTERM / SIGINT, or the operator removed this peer through the coordinator): announce
`leaving`, let in-flight requests finish while new ones are refused, stop the DHT node and its
p2pd, exit 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import gc
import logging
import multiprocessing
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlencode

import httpx
import torch
from hivemind.utils import get_dht_time

from peer.checkpoint import writable_dir
from peer.options import PeerOptions
from peer.reach import PeerReach, reach_before_serving, unreachable
from peer.resume import StageLoader
from peer.service import start_server
from peer.throughput import cached_throughput, capacity, link_speed, sample_bytes
from swarm import memory
from swarm.config import ConfigError, RunConfig
from swarm.device import resolve_device
from swarm.identity import Member
from swarm.join import join_dht
from swarm.placement import pick_stage
from swarm.ready import PeerReady, write_ready
from swarm.rebalance import expected_move_s, peer_steadiness, should_move, stage_totals
from swarm.records import (
    REFRESH_S,
    PeerRecord,
    SwarmView,
    announce_peer,
    maddr_peer_ids,
    read_removed,
    read_swarm,
    shutdown_dht,
    visible_maddrs,
)
from swarm.steps import others_step

log = logging.getLogger(__name__)
T = TypeVar("T")

# Leaving (the drain, the stage's optimizer, the DHT node) is bounded piece by piece; should any
# of it hang anyway, the process dumps every thread's stack to stderr and exits (code 1) after this.
EXIT_DEADLINE_S = 20.0
# The daemon's loop waits this long for a DHT read (its stage's records, removals) before it goes on
# without it: two refresh periods, above hivemind's 3 s per call to a node that does not answer.
DHT_READ_TIMEOUT_S = 2 * REFRESH_S
# Peers that start together wait a random time up to this before they pick a stage, so that each
# sees the ones before it and they spread out.
SPREAD_WAIT_S = 2.0


class PeerDaemon:
    """One peer's life in the swarm: serve a stage, refresh its record, maybe move, leave."""

    def __init__(
        self,
        run: RunConfig,
        dht,
        device: torch.device,
        options: PeerOptions,
        coordinators: set[str] | None,
        member: Member | None = None,
        fits: list[int] | None = None,
    ):
        """`options.port`: the stage service's port, kept across moves (0: the first free one);
        `coordinators`: the DHT peer ids whose removal records count (the coordinator joined through;
        None: anyone's); `member`: this peer's run membership, its stage service's TLS identity;
        `fits`: the stages this device can hold (swarm/memory.py), the only ones it moves to (None: all)."""
        self.run, self.dht, self.device, self.options, self.coordinators = run, dht, device, options, coordinators
        self.member, self.fits = member, fits
        self.port = options.port
        peer_id = dht.peer_id.to_base58()
        self.record = PeerRecord(
            peer_id=peer_id,
            stage=0,
            address="",
            public_name=options.public_name or peer_id[-8:],
            device=str(device),
            state="joining",
            started=time.time(),
            dht_addrs=visible_maddrs(dht),
        )
        self.server = self.worker = None
        self.measured = 0.0
        self.load_s = 0.0  # how long this peer's last load of a stage took (its worker and state)
        self.link: tuple[float, float] | None = None  # (uplink, downlink) bits/s, from the coordinator's link test
        self.reach = PeerReach(self, run, dht, options, member)
        self.loader = StageLoader(self, run, dht, device, options)
        self.steadiness = peer_steadiness()

    @property
    def name(self) -> str:
        return self.record.public_name

    def announce(self, timeout: float | None = REFRESH_S, **update) -> None:
        if "optimizer_steps" in update:
            update["optimizer_steps"] = self.options.faults.claimed_steps(update["optimizer_steps"])
        self.record = self.record.model_copy(update=update)
        announce_peer(self.dht, self.run.run_id, self.record, timeout=timeout)

    def serve(self, stage: int) -> None:
        """Join `stage`: announce joining, measure, take the stage's current weights, serve, go online."""
        self.announce(stage=stage, state="joining", address="", moving_to=None, ready_at=None, capacity=0.0)
        log.info(f"peer {self.name}: joining stage {stage} of run {self.run.run_id!r}")
        # Announced at once: peers that join while this one downloads count it on its stage
        # (swarm/rebalance.py `stage_totals`).
        self.measured = self.stage_capacity(stage)
        self.announce(capacity=self.measured)
        began = time.monotonic()
        self.worker = self.loader.new_worker(stage)
        source = self.loader.take_state(stage, self.worker)
        self.load_s = time.monotonic() - began
        self.go_online(stage, source)

    def stage_capacity(self, stage: int) -> float:
        """What this peer can serve of `stage`, in samples/s: its device's throughput (a stand-in for a
        slower device is slower from the start), through its link when the link was measured."""
        measured = self.options.faults.slowed(cached_throughput(self.run, stage, self.device))
        if self.link is not None:
            measured = capacity(measured, *self.link, *sample_bytes(self.run, stage))
        return measured

    def go_online(self, stage: int, source: str) -> None:
        """Serve `self.worker`, loaded with `stage`'s state from `source`, and announce it online."""
        self.track_swarm()  # before it serves: no request may move it past the swarm's step
        # The port stays the same across moves, so the address the trainers know stays right.
        opts = self.options
        self.server, _, self.port = start_server(self.worker, opts.host, self.port, member=self.member)
        self.announce(
            stage=stage,
            address=self.reach.address(),
            device=self.worker.device_name,
            throughput=self.measured,
            capacity=self.measured,
            state="online",
            moving_to=None,
            ready_at=None,
            samples_served=0,
            optimizer_steps=self.worker.optimizer_steps,
            weights_from=source,
        )
        log.info(
            f"peer {self.name}: online, stage {stage}, serving on {self.record.address} ({self.worker.device_name}, "
            f"{self.measured:.1f} samples/s measured, weights from {source})"
        )
        if self.options.ready_file is not None:
            r = self.record
            ready = PeerReady(
                run_id=self.run.run_id, stage=stage, address=r.address, peer_id=r.peer_id, public_name=r.public_name
            )
            write_ready(self.options.ready_file, ready)

    def refresh(self) -> None:
        live = self.worker.throughput
        self.announce(
            throughput=live if live > 0 else self.measured,
            queue=len(self.worker.queue),
            samples_served=self.worker.samples_served,
            optimizer_steps=self.worker.optimizer_steps,
        )

    def removed(self, timeout: float | None = None) -> bool:
        """Whether the operator removed this peer from the run (through the coordinator). A member of
        the run reads the removed peers every REVOCATION_POLL_S already (swarm/identity.py: they are
        its revoked callers): its last reading answers, for no DHT read of its own. Otherwise the
        records are read here, `timeout` bounding the read (TimeoutError)."""
        if self.member is not None:
            return self.record.peer_id in self.member.revoked
        return self.record.peer_id in read_removed(self.dht, self.run.run_id, self.coordinators, timeout)

    def leave_stage(self, timeout: float = 0, moving_to: int | None = None) -> None:
        """Announce leaving (for stage `moving_to`, if moving), let in-flight requests finish (new
        ones are refused), stop the worker."""
        # Same time to live as any refresh: the DHT keeps, per subkey, the value that expires last,
        # so a shorter-lived "leaving" would be ignored in favour of the last "online". No wait for
        # the store (timeout 0): the DHT process goes on with it while the requests drain.
        started = time.monotonic()
        self.announce(timeout=timeout, state="leaving", moving_to=moving_to)
        announced = time.monotonic()
        if self.server is not None:
            self.server.stop(grace=3)
        drained = time.monotonic()
        if self.worker is not None:
            self.worker.close()
        self.server = None
        # hivemind's optimizer leaves threads behind that end only when the garbage collector frees
        # what holds them (its progress tracker runs an event loop that it never closes, with 3
        # executor threads): freed now, not after some later full collection.
        gc.collect()
        log.info(
            f"peer {self.name}: left stage {self.record.stage} in {time.monotonic() - started:.1f} s "
            f"(announce {announced - started:.1f} s, drain {drained - announced:.1f} s, "
            f"worker {time.monotonic() - drained:.1f} s)"
        )

    def track_swarm(self, timeout: float | None = None) -> SwarmView:
        """Read the swarm, and tell the worker the step most of the other machines announce: how far a
        request may move it (peer/stepper.py `reachable`); `timeout` bounds its DHT reads together (TimeoutError)."""
        view = read_swarm(self.dht, self.run.run_id, self.run.stages.count, timeout)
        self.worker.stepper.swarm_step = others_step(view, self.record.peer_id)
        return view

    def watch(self, timeout: float | None = None) -> SwarmView | None:
        """`track_swarm`; the view when it is steady enough to rebalance on (swarm/rebalance.py:
        `Steadiness`), else None. Called at every refresh, so that a change between two checks is seen."""
        view = self.track_swarm(timeout)
        return view if self.steadiness.observe(view, get_dht_time()) else None

    def rebalance(self, view: SwarmView) -> None:
        """Move to the stage the swarm needs most, when that is clearly better (swarm/rebalance.py)."""
        target = should_move(view, self.record, self.run.rebalance.margin, self.fits)
        if target is not None:
            self.move(target)

    def move(self, target: int) -> None:
        """Move from this peer's stage to stage `target`. Make before break: the peer goes on serving its
        stage while it takes the target's state, and switches only once that is loaded; it stops first
        only when the device has no room for both stages (`swarm.memory.fits_beside`)."""
        source = self.record.stage
        inflight = memory.peer_inflight(self.run, self.options.inflight)
        free = memory.available(self.device)
        if not memory.fits_beside(self.run, source, target, self.device.type, inflight, free, self.options.max_memory):
            log.info(f"peer {self.name}: moving from stage {source} to stage {target}, no room for both: stops first")
            # Wait for the DHT to take "leaving" (with the target): a peer checking next must count this
            # peer on its new stage, or it moves too.
            self.leave_stage(timeout=2, moving_to=target)
            self.serve(target)
            return
        log.info(f"peer {self.name}: moving from stage {source} to stage {target}, serving stage {source} meanwhile")
        measured = self.stage_capacity(target)
        # Online with `moving_to`: the trainers go on calling it on its stage until `ready_at`, then on the
        # target (swarm/records.py `SwarmView.routable`); peers that check count it on the target
        # (swarm/rebalance.py `placements`), so that they do not move there too.
        began = time.monotonic()
        scale = memory.stage_parameters(self.run, target) / max(1, memory.stage_parameters(self.run, source))
        ready_at = get_dht_time() + expected_move_s(self.load_s, scale)
        self.announce(timeout=2, moving_to=target, ready_at=ready_at, capacity=measured)
        with self.refreshing():
            worker = self.loader.new_worker(target)
            try:
                source_of_state = self.loader.take_state(target, worker)
            except BaseException:
                worker.close()
                self.announce(moving_to=None, ready_at=None, capacity=self.measured)
                raise
        self.load_s = time.monotonic() - began
        self.leave_stage(timeout=2, moving_to=target)
        self.worker, self.measured = worker, measured
        self.go_online(target, source_of_state)

    @contextlib.contextmanager
    def refreshing(self):
        """Keep the record refreshed (`refresh`) while the daemon's loop waits on something long: a record
        not refreshed for TTL_S expires, and its peer drops out of the trainers' view of its stage."""
        done = threading.Event()

        def loop() -> None:
            while not done.wait(REFRESH_S):
                try:
                    self.refresh()
                except Exception as err:  # a DHT store that failed: the next one may not
                    log.warning(f"peer {self.name}: record not refreshed: {err}")

        thread = threading.Thread(target=loop, name="refresh-while-moving", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()


def exit_now(code: int) -> None:
    """End the process once `run_peer` has stopped everything it started (the worker, the
    averagers, the DHT node and its p2pd). hivemind leaves threads of its own behind (its progress
    tracker's loop, its executors' workers) that the interpreter would join at exit, and some of
    them wait on a DHT that is gone: a normal exit can hang there for good."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def end_children(timeout: float = 5.0) -> None:
    """SIGKILL what this process forked that still runs (multiprocessing's children: hivemind's
    averagers, which ignore SIGTERM with the handler they inherit). A leaving worker ends its own, but
    the averagers of a start cut short (`StoppedWhileStarting`) have nobody to end them, and
    `exit_now` skips multiprocessing's ending of its children: they outlived the peer."""
    children = multiprocessing.active_children()
    for child in children:
        child.kill()
    for child in children:
        child.join(timeout)


class StoppedWhileStarting(Exception):
    """SIGTERM or SIGINT before the peer was online: raised where the start was (joining its stage,
    measuring, taking the stage's state, waiting on a DHT that may be going down with the swarm), so
    that the peer leaves at once; a start that ran on took many seconds more, then a SIGKILL."""


def run_peer(options: PeerOptions) -> int:
    """Join the run of `options.coordinator` and serve until a signal or the operator's removal.
    `options.checkpoint_dir` is checked before anything starts."""
    if options.checkpoint_dir is not None:
        try:
            options = dataclasses.replace(options, checkpoint_dir=writable_dir(options.checkpoint_dir))
        except OSError as err:
            raise ConfigError(
                f"--checkpoint-dir: cannot write to {options.checkpoint_dir}: {err.strerror or err}"
            ) from None
    stage = options.stage
    if options.threads:
        torch.set_num_threads(options.threads)
    dev = resolve_device(options.device)
    limit = memory.budget(dev, options.max_memory)

    def check_stage(run: RunConfig) -> None:
        """Refuse, before anything starts, a stage the run lacks or this device cannot hold."""
        if stage is not None and not 0 <= stage < run.stages.count:
            raise ConfigError(f"--stage: {stage} is not a stage of run {run.run_id!r} (0..{run.stages.count - 1})")
        inflight = memory.peer_inflight(run, options.inflight)
        if stage is not None:
            memory.check_stage(run, stage, dev.type, inflight, limit)
        elif not memory.fitting_stages(run, dev.type, inflight, limit):
            smallest = min(range(run.stages.count), key=lambda k: memory.estimate(run, k, dev.type, inflight).total)
            memory.check_stage(run, smallest, dev.type, inflight, limit)

    host = options.host
    dht_host = host if host not in ("", "::") else "0.0.0.0"
    reach = reach_before_serving(options, dht_host)
    if unreachable(reach):
        log.info("the coordinator cannot dial this machine: its DHT node dials out only (client mode)")
    run, initial_peers, dht, member = join_dht(
        options.coordinator,
        "peer",
        options.join_token,
        options.join_wait,
        check_stage,
        host=dht_host,
        port=options.dht_port,
        announce_host=options.announce_host,
        client_mode=unreachable(reach),
    )
    fits = memory.fitting_stages(run, dev.type, memory.peer_inflight(run, options.inflight), limit)
    peer = PeerDaemon(run, dht, dev, options, maddr_peer_ids(initial_peers), member, fits)
    stop = threading.Event()
    starting = True  # until the peer is online, a signal ends its start at once (`StoppedWhileStarting`)
    main = os.getpid()  # the averagers' processes, forked from this one, inherit the handler: they wait for it

    def on_signal(*_) -> None:
        nonlocal starting
        stop.set()
        if starting and os.getpid() == main:
            starting = False  # once: a second signal must not cut the leaving short
            raise StoppedWhileStarting

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        try:
            peer.link = link_speed(options.coordinator, options.join_token)
            log.info(f"peer {peer.name}: link {peer.link[0] / 1e6:.0f} Mbit/s up, {peer.link[1] / 1e6:.0f} down")
        except httpx.HTTPError as err:  # a coordinator without the link test: the device's speed alone
            log.warning(f"peer {peer.name}: no link test ({err}); capacity announced from the device alone")
        if stage is None:
            time.sleep(random.uniform(0, SPREAD_WAIT_S))  # peers that start together spread out
            view = read_swarm(dht, run.run_id, run.stages.count)
            counts = [len(view.stages[k]) for k in range(run.stages.count)]
            stage = pick_stage(stage_totals(view), counts, fits)
        peer.serve(stage)
        peer.reach.check(reach)
        if options.relay > 0:
            peer.reach.run_relay(options.relay)
        starting = False  # a signal from here on ends the loop below: the peer leaves its stage
        me = peer.record.public_name or peer.record.peer_id  # the dashboard's ?peer= takes either
        print(f"peer {me} online: {options.coordinator.rstrip('/')}/?{urlencode({'peer': me})}", flush=True)
        period = run.rebalance.period_s

        def next_check() -> float:
            # Randomised, so that peers seeing the same swarm do not all move at once.
            return time.monotonic() + random.uniform(0.5, 1.5) * period

        check_at, last_status = next_check(), time.monotonic()
        stalled = False  # the loop's last DHT read went unanswered

        def answered(read: Callable[[], T]) -> T | None:
            """`read`'s value, None when the DHT did not answer it in time (said once per stall)."""
            nonlocal stalled
            try:
                value = read()
            except TimeoutError:
                if not stalled:
                    log.warning(
                        f"peer {peer.name}: a DHT read got no answer in {DHT_READ_TIMEOUT_S:g} s (a node frozen or "
                        "cut off?); serving on with the swarm as last read"
                    )
                stalled = True
                return None
            if stalled:
                log.info(f"peer {peer.name}: the DHT answers again")
            stalled = False
            return value

        checks = options.rebalance or options.faults.restless
        refresh_at = time.monotonic() + REFRESH_S

        def until_due() -> float:
            # The next refresh, or the next check when it comes first: a check waited for the refresh after
            # it (every REFRESH_S), so a peer moved later than its period said, by 2 s on average.
            due = min(refresh_at, check_at) if checks else refresh_at
            return max(0.0, due - time.monotonic())

        # Each DHT read is bounded, and the stop is looked at between them: a DHT node that froze (SIGSTOP,
        # a machine that hangs) kept a read waiting with no end, and the loop then neither refreshed this
        # peer's record nor left on Ctrl-C. The record's store is bounded too (`announce`).
        while not stop.wait(until_due()):
            view = None
            if time.monotonic() >= refresh_at:
                refresh_at = time.monotonic() + REFRESH_S
                if answered(lambda: peer.removed(DHT_READ_TIMEOUT_S)):
                    log.warning(f"peer {peer.name}: removed from the run by the operator")
                    break  # and leave as on SIGTERM
                if stop.is_set():
                    break
                peer.refresh()
                if stop.is_set():
                    break
                if not options.rebalance:
                    answered(lambda: peer.track_swarm(DHT_READ_TIMEOUT_S))
            elif time.monotonic() < check_at:
                continue
            # At every refresh and check; a check that falls due while the swarm is unsteady waits for it
            # to settle.
            if options.rebalance:
                view = answered(lambda: peer.watch(DHT_READ_TIMEOUT_S))
            if options.faults.restless and time.monotonic() >= check_at:
                peer.move((peer.record.stage + 1) % run.stages.count)
                check_at = next_check()
            elif view is not None and time.monotonic() >= check_at:
                peer.rebalance(view)
                check_at = next_check()
            elif time.monotonic() >= check_at:
                check_at = refresh_at  # unsteady, or unread: looked at again with the next refresh's view
            if time.monotonic() - last_status > 30:
                last_status = time.monotonic()
                w = peer.worker
                log.info(
                    f"peer {peer.name}: stage {peer.record.stage}, {w.samples_served} samples served, "
                    f"{w.optimizer_steps} steps, {peer.record.throughput:.1f} samples/s, queue {peer.record.queue}; "
                    f"{w.time_use()}"
                )
        log.info(f"peer {peer.name}: leaving")
        return 0
    except StoppedWhileStarting:
        log.info(f"peer {peer.name}: stopped while starting")
        return 0
    finally:
        faulthandler.dump_traceback_later(EXIT_DEADLINE_S, exit=True)
        worker = peer.worker
        peer.leave_stage()
        member.stop()
        shutdown_dht(dht)
        end_children()
        if worker is not None:
            print(
                f"peer stopped after {worker.samples_served} samples and {worker.optimizer_steps} steps "
                f"({worker.time_use()})",
                flush=True,
            )
