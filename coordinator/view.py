"""The coordinator's picture of the swarm: refreshed from the DHT in the background.

HTTP requests are answered from the latest view only; they never wait on the DHT. A reader thread
re-reads the run's records (and the operator's control record) every `interval` seconds and swaps
the new view in under a lock, then tells the holder's listeners (the history recorder) of the change
from the previous view to the new one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import hivemind

from swarm.records import ControlState, SwarmView, read_control, read_swarm

log = logging.getLogger(__name__)

# Told of every new view, with the one it replaces; runs on the reader thread.
ViewListener = Callable[[SwarmView, SwarmView], None]


def empty_view(num_stages: int) -> SwarmView:
    """The view at start-up: the coordinator is the run's first DHT node, so nobody is known yet."""
    return SwarmView(stages=[[] for _ in range(num_stages)], trainers=[], read_at=time.time())


class ViewHolder:
    """The latest SwarmView, shared between the reader thread and request handlers."""

    def __init__(self, view: SwarmView):
        self._lock = threading.Lock()
        self._view = view
        self._control = ControlState()
        self._listeners: list[ViewListener] = []
        self.reads = 0  # successful reads since start
        self.failures = 0  # reads that raised
        self.wanted = threading.Event()  # set: read the DHT now, not at the end of the interval

    def read_soon(self) -> None:
        """Have the reader read the DHT now: something changed that the view should show at once (a peer
        just came online), not up to an interval later."""
        self.wanted.set()

    def get(self) -> SwarmView:
        with self._lock:
            return self._view

    def control(self) -> ControlState:
        """The run's control record as last read from the DHT (not paused until one is read)."""
        with self._lock:
            return self._control

    def listen(self, listener: ViewListener) -> None:
        self._listeners.append(listener)

    def set(self, view: SwarmView, control: ControlState | None = None) -> None:
        with self._lock:
            old, self._view = self._view, view
            if control is not None:
                self._control = control
            self.reads += 1
        for listener in self._listeners:
            try:
                listener(old, view)
            except Exception:  # a listener's bug must not stop the view from refreshing
                log.exception("a listener of the swarm view failed")

    def failed(self) -> None:
        with self._lock:
            self.failures += 1


class SwarmReader(threading.Thread):
    """Reads the run's records from the DHT into a ViewHolder every `interval` seconds until stopped,
    and sooner when asked (`ViewHolder.read_soon`)."""

    MIN_GAP_S = 0.25

    def __init__(self, dht: hivemind.DHT, run_id: str, num_stages: int, holder: ViewHolder, interval: float = 1.0):
        # A daemon thread: a DHT call that never returns (its process already gone) cannot keep
        # the interpreter alive at exit.
        super().__init__(name="swarm-reader", daemon=True)
        self.dht, self.run_id, self.num_stages = dht, run_id, num_stages
        self.holder, self.interval = holder, interval
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            started = time.monotonic()
            try:
                view = read_swarm(self.dht, self.run_id, self.num_stages)
                control = read_control(self.dht, self.run_id, {self.dht.peer_id.to_base58()})  # its own word
            except Exception as err:  # noqa: BLE001 (keep serving the last good view)
                if self._stop_event.is_set():
                    return
                self.holder.failed()
                log.warning("reading the swarm from the DHT failed: %s", err)
            else:
                self.holder.set(view, control)
            if self.holder.wanted.wait(max(0.0, self.interval - (time.monotonic() - started))):
                self.holder.wanted.clear()
                # Asked for at once, but never more often than this: many asks (peers coming online
                # together, or a member asking again and again) cost one read each MIN_GAP_S.
                self._stop_event.wait(max(0.0, self.MIN_GAP_S - (time.monotonic() - started)))

    def stop(self, timeout: float = 3.0) -> None:
        self._stop_event.set()
        self.holder.wanted.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)
