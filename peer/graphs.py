"""The graphs of training forwards, kept for their backward, and the weights they were recorded on.

Backward is stateless: it recomputes the forward from the input it is given. A short-lived cache
keeps the autograd graph of each training forward (one graph per request, also when requests came
together), so that when the same peer also gets the matching backward the recompute is skipped.
A graph is used at the weights it was recorded on. The stage's step changes the weights in place, so
a graph recorded before it is dropped, but for a trainer with delayed updates (`delayed`): the
weights are copied before the step (`WeightsAt`), and its backward runs on the graph as recorded, a
gradient one step stale that counts toward the next step, as SWARM's delayed parameter updates have
it, instead of running the forward again on the new weights.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass

import torch

from peer.requests import CachedForward


@dataclass
class _SavedWeight:
    """A weight (or a view of one) that a recorded graph saved for its backward."""

    index: int
    tensor: torch.Tensor


class WeightsAt:
    """The stage's trainable weights at one version (`RecordedGraphs.version`), as graphs
    recorded on them see them: the parameters themselves until the weights are about to change, a
    copy from then on (`keep`). Graphs are recorded under its `hooks`, which save a weight by
    reference and hand the copy back in backward once there is one: autograd would otherwise refuse
    the backward (the step changed a saved tensor in place) or, with no check, use the new weights."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self._storages: dict[int, int] = {}  # a weight's storage -> its index, from the first `hooks`
        self.kept: list[torch.Tensor] | None = None
        self.watched = False  # a graph was recorded under `hooks`: its backward may come after a step

    def keep(self) -> None:
        """Copy the weights as they are now; before they change in place. Under the worker's lock."""
        if self.kept is None:
            with torch.no_grad():
                # Whole storages, flat: a saved view is rebuilt with its own size, stride and offset.
                self.kept = [p.new_empty(0).set_(p.untyped_storage().clone()) for p in self.params]

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        if not self.watched:  # only delayed trainers' graphs are watched: nothing to map for the others
            self._storages = {p.untyped_storage().data_ptr(): i for i, p in enumerate(self.params)}
        self.watched = True
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor | _SavedWeight:
        index = self._storages.get(t.untyped_storage().data_ptr())
        return t if index is None else _SavedWeight(index, t)

    def _unpack(self, saved: torch.Tensor | _SavedWeight) -> torch.Tensor:
        if not isinstance(saved, _SavedWeight):
            return saved
        t = saved.tensor
        if self.kept is None:
            return t
        return self.kept[saved.index].as_strided(t.size(), t.stride(), t.storage_offset())


class ForwardCache:
    """The recorded graphs of training forwards, newest last, at most `size` of them."""

    def __init__(self, size: int):
        self.size = size
        self.entries: collections.OrderedDict[str, CachedForward] = collections.OrderedDict()
        self.lock = threading.Lock()

    def put(self, microbatch_id: str, entry: CachedForward) -> None:
        with self.lock:
            self.entries[microbatch_id] = entry
            while len(self.entries) > self.size:
                self.entries.popitem(last=False)

    def claim(self, microbatch_id: str, version: int) -> CachedForward | None:
        """Take this microbatch's recorded forward, if it is still here and usable at `version`."""
        with self.lock:
            entry = self.entries.pop(microbatch_id, None)
        return entry if entry is not None and usable(entry, version) else None

    def keep_usable(self, version: int) -> None:
        """Drop the graphs that cannot be used at `version` (the weights changed)."""
        with self.lock:
            for mb_id in [m for m, e in self.entries.items() if not usable(e, version)]:
                del self.entries[mb_id]


def usable(entry: CachedForward, version: int) -> bool:
    """A recorded graph can serve its backward at weights `version`: it was recorded at that version,
    or it is a delayed trainer's recorded one step before, on weights copied before they changed."""
    if entry.version == version:
        return True
    return entry.delayed and entry.version == version - 1 and entry.weights.kept is not None


class RecordedGraphs:
    """The training forwards' graphs kept for their backward (`cache`), and the version of the stage's
    weights they are recorded on (`version`). The version goes up whenever the weights change (a step,
    a skip, or the stage's state or a checkpoint loaded in place): a recorded forward is used only at
    the version it was recorded at, or a delayed trainer's one version later (`usable`)."""

    def __init__(self, stage: torch.nn.Module, cache_size: int):
        self.stage = stage
        self.cache = ForwardCache(cache_size)
        self.version = 0
        self.weights = self._weights_now()

    def claim(self, microbatch_id: str) -> CachedForward | None:
        """Take this microbatch's recorded forward, if it is still here and still usable."""
        return self.cache.claim(microbatch_id, self.version)

    def usable(self, entry: CachedForward) -> bool:
        """`entry` can serve its backward on the weights as they are now."""
        return usable(entry, self.version)

    def keep_weights(self) -> None:
        """Before the stage's step: copy the weights that delayed trainers' graphs still need (in the
        cache, or claimed by a backward that has not run yet)."""
        if self.weights.watched:
            self.weights.keep()

    def changed(self) -> None:
        """The weights changed: a new version, and the graphs that cannot serve it are dropped."""
        self.version += 1
        self.weights = self._weights_now()
        self.cache.keep_usable(self.version)

    def _weights_now(self) -> WeightsAt:
        return WeightsAt([p for p in self.stage.parameters() if p.requires_grad])
