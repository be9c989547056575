"""A DHT call's way back from hivemind's DHT process, sent once per calling process, not per call.

A call to a `hivemind.DHT` (get, store, run_coroutine) goes to the DHT's process through a pipe, with
an MPFuture for its result. hivemind pickles with that future the calling process's result pipe (a
multiprocessing Connection), and a Connection is pickled as a file descriptor handed over through
multiprocessing's resource sharer: on every call the DHT process connects to a thread of the caller,
both sides run an HMAC handshake and the descriptor crosses, to be closed after the one result. In a
training swarm that was a seventh of a DHT process's CPU (py-spy) and some of the caller's, for a
pipe that is the same for every call of a process (hivemind's MPFuture has one per process).

`cheap_calls(dht)` makes the DHT object send a process's pipe with that process's first call only;
the DHT process keeps it by the caller's pid (`_PIPES`) and gives it to the later calls' futures. A
process forked with the DHT object (an averager) has another pid, so its first call sends its own.
"""

from __future__ import annotations

import os
import threading
from multiprocessing.connection import Connection

import hivemind
from hivemind.utils.mpfuture import MPFuture

# In the DHT's process: each calling process's result pipe, by the caller's pid (`_future`).
_PIPES: dict[int, Connection] = {}
# In a calling process: held while a call is sent (`_CallPipe`); a forked child starts with a new one.
_sending = threading.Lock()


def _new_lock() -> None:
    global _sending
    _sending = threading.Lock()


os.register_at_fork(after_in_child=_new_lock)


def _future(state: dict, pipe: Connection | None) -> MPFuture:
    """The DHT process's copy of a caller's future: with the pipe it came with, else the one that
    process sent with its first call."""
    origin = state["_origin_pid"]
    if pipe is not None:
        _PIPES[origin] = pipe
    elif origin not in _PIPES:
        # RuntimeError: hivemind's DHT loop logs it and reads on (the caller's future never resolves,
        # as with any call the DHT process could not read).
        raise RuntimeError(f"a DHT call from process {origin}, whose first call never arrived")
    future = MPFuture.__new__(MPFuture)
    future.__setstate__({**state, "_sender_pipe": _PIPES[origin]})
    return future


class _Sent:
    """An MPFuture as a call sends it: hivemind's state without the result pipe, which goes along only
    when `with_pipe`."""

    def __init__(self, future: MPFuture, with_pipe: bool):
        self.future, self.with_pipe = future, with_pipe

    def __reduce__(self):
        state = self.future.__getstate__()
        pipe = state.pop("_sender_pipe")
        return _future, (state, pipe if self.with_pipe else None)


class _CallPipe:
    """The caller's end of a DHT's call pipe (hivemind's `_outer_pipe`), sending each process's result
    pipe with its first call only. Calls are sent one at a time (`_sending`), so that no call of a
    process overtakes the one that carries its pipe."""

    def __init__(self, pipe: Connection):
        self.pipe = pipe
        self._piped: int | None = None  # the pid whose result pipe went through this pipe (a fork's differs)

    def send(self, message) -> None:
        method, args, kwargs = message
        future = kwargs.get("future")
        with _sending:
            if not isinstance(future, MPFuture):
                self.pipe.send(message)
                return
            pid = os.getpid()
            self.pipe.send((method, args, {**kwargs, "future": _Sent(future, with_pipe=self._piped != pid)}))
            self._piped = pid

    def __getattr__(self, name):  # close, fileno, poll: the pipe's own
        return getattr(self.pipe, name)


def cheap_calls(dht: hivemind.DHT) -> hivemind.DHT:
    """`dht` (made, not yet started), its calls sending each process's result pipe once (the module's
    docstring)."""
    dht._outer_pipe = _CallPipe(dht._outer_pipe)
    return dht
