"""Documents in, batches of token windows out: streamed shard by shard, in bounded memory.

Each shard of the source (swarm/sources.py) is read lazily; its documents are tokenized on the fly
and packed end to end, joined by SEPARATOR, into windows of seq_len + 1 tokens. Window n of shard i
has the id (i, n). A trainer takes shards from a `ShardSource` (`LocalShards`: one trainer reads
them all; a coordinator's leases hand them between trainers) and draws its microbatches through a
seeded shuffle buffer of SHUFFLE_WINDOWS windows.

Validation is a fixed set of documents, chosen by a stable hash of (shard name, document index):
the same in every process, and never trained on.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Protocol

import torch

from swarm.config import ConfigError, DataConfig
from swarm.sources import TEXT_SUFFIXES, Documents, Shard, readers, shards
from swarm.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "TEXT_SUFFIXES",
    "Batch",
    "ByteTokenizer",
    "DataExhausted",
    "LocalShards",
    "Shard",
    "ShardSource",
    "Tokenizer",
    "TrainStream",
    "is_validation",
    "shards",
    "windows",
]

SEPARATOR = "\n\n"  # between documents: what joined the embedded topics before streaming
SHUFFLE_WINDOWS = 256
UNIGRAM_TRAIN_TOKENS = 2_000_000  # the unigram baseline counts this many training tokens at most...
UNIGRAM_VAL_TOKENS = 200_000  # ...and scores this many validation tokens


@dataclass(frozen=True)
class Batch:
    inputs: torch.Tensor  # [B, T] token ids
    targets: torch.Tensor  # [B, T] the next token of each input position
    ids: tuple[tuple[int, int], ...] = ()  # (shard index, window index) of each row


class DataExhausted(Exception):
    """The shard source has no shard left and every window read was handed out."""


def is_validation(shard: Shard, document: int, fraction: float) -> bool:
    """Whether document `document` of `shard` is held out: a stable hash, the same in every process."""
    digest = hashlib.blake2b(f"{shard.name}\0{document}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") < fraction * 2**64


def windows(documents: Iterable[str], tokenizer: Tokenizer, seq_len: int) -> Iterator[torch.Tensor]:
    """The documents tokenized and packed end to end (joined by SEPARATOR) into windows of
    seq_len + 1 tokens; the tail shorter than a window is dropped."""
    width = seq_len + 1
    # A tokenizer with an end-of-document token separates documents with it, as exported models expect.
    sep = tokenizer.encode(SEPARATOR) if tokenizer.eos_id is None else torch.tensor([tokenizer.eos_id])
    parts: list[torch.Tensor] = []
    held = 0
    for text in documents:
        if parts:
            parts.append(sep)
            held += len(sep)
        ids = tokenizer.encode(text)
        parts.append(ids)
        held += len(ids)
        if held >= width:
            flat = torch.cat(parts)
            n = len(flat) // width
            # Clones, so that a window kept in the shuffle buffer does not keep a whole document alive.
            yield from (row.clone() for row in flat[: n * width].view(n, width))
            parts = [flat[n * width :].clone()]
            held = len(parts[0])


def _split(shard: Shard, read: Documents, fraction: float, validation: bool) -> Iterator[str]:
    return (text for i, text in enumerate(read()) if is_validation(shard, i, fraction) == validation)


class ShardSource(Protocol):
    def next_shard(self) -> tuple[Shard, int, int] | None:
        """The next shard to read, the window to start at and its epoch; None: no shard for now."""

    def progress(self, shard: Shard, epoch: int, offset: int) -> None:
        """Windows 0 .. offset - 1 of `shard`, taken in `epoch`, are read and trained."""

    def done(self, shard: Shard, epoch: int) -> None:
        """Every window of `shard`, taken in `epoch`, is trained (a trainer may hold a shard in two epochs)."""


def epoch_order(count: int, seed: int, epoch: int) -> list[int]:
    """The order in which an epoch reads the run's `count` shards, drawn from the run's seed: one
    trainer reading alone and the coordinator's leases (coordinator/leases.py) take the same, so a
    trainer on a swarm sees the windows a trainer alone would, in the same order."""
    order = list(range(count))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


class LocalShards:
    """One trainer reads every shard: each epoch in an order drawn from the seed, epochs without end.
    It keeps what it was told (`offsets`, `finished`) for whoever asks."""

    def __init__(self, shards: list[Shard], seed: int):
        if not shards:
            raise ConfigError("data: the source has no shards")
        self.shards, self.seed = list(shards), seed
        self.epoch = -1
        self.queue: list[Shard] = []
        self.offsets: dict[int, int] = {}
        self.finished: list[Shard] = []

    def next_shard(self) -> tuple[Shard, int, int]:
        if not self.queue:
            self.epoch += 1
            self.queue = [self.shards[k] for k in epoch_order(len(self.shards), self.seed, self.epoch)]
            self.offsets.clear()
        return self.queue.pop(0), 0, self.epoch

    def progress(self, shard: Shard, epoch: int, offset: int) -> None:
        if epoch == self.epoch:
            self.offsets[shard.index] = offset

    def done(self, shard: Shard, epoch: int) -> None:
        self.finished.append(shard)


@dataclass(eq=False)  # told apart by identity: one shard may be open twice, in two epochs
class _Reading:
    """One shard taken from the source: how far it is read, and which of its windows are not yet trained."""

    shard: Shard
    epoch: int
    windows: Iterator[torch.Tensor] | None  # None once read to its end
    read: int  # windows read so far (the next one's index)
    reported: int
    untrained: set[int] = field(default_factory=set)

    def trained_below(self) -> int:
        return min(self.untrained) if self.untrained else self.read


class TrainStream:
    """A trainer's data: microbatches of training windows from the shards its source hands it, and
    the fixed validation set. Not thread-safe: one caller draws and reports."""

    def __init__(
        self,
        cfg: DataConfig,
        seq_len: int,
        seed: int,
        tokenizer: Tokenizer,
        source: ShardSource,
        buffer: int = SHUFFLE_WINDOWS,
    ):
        self.cfg, self.seq_len, self.tokenizer, self.source = cfg, seq_len, tokenizer, source
        self.readers = readers(cfg)
        self.capacity = buffer
        self.rng = random.Random(seed)
        self.buffer: list[tuple[tuple[int, int], torch.Tensor]] = []
        self.open: list[_Reading] = []  # oldest first; the last may still be reading
        self.epoch_now = 0  # the epoch of the shard read last
        self.epoch_read: int | None = None  # the epoch in which a window was last read
        self._val: list[torch.Tensor] | None = None

    @classmethod
    def local(cls, cfg: DataConfig, seq_len: int, seed: int, tokenizer: Tokenizer | None = None) -> TrainStream:
        """The stream of a trainer that reads every shard itself (in the run's tokenizer by default)."""
        tokenizer = tokenizer or load_tokenizer(cfg.tokenizer)
        return cls(cfg, seq_len, seed, tokenizer, LocalShards(shards(cfg), seed))

    # -- training ---------------------------------------------------------------------------

    def next_microbatch(self, size: int) -> Batch:
        """`size` training windows drawn at random from the buffer (fewer only when the source has run
        out; DataExhausted when none is left)."""
        rows = []
        for _ in range(size):
            self._fill()
            if not self.buffer:
                break
            k = self.rng.randrange(len(self.buffer))
            self.buffer[k], self.buffer[-1] = self.buffer[-1], self.buffer[k]
            rows.append(self.buffer.pop())
        if not rows:
            raise DataExhausted("every shard the source handed out is read")
        win = torch.stack([w for _, w in rows])
        return Batch(win[:, :-1].contiguous(), win[:, 1:].contiguous(), tuple(i for i, _ in rows))

    def trained(self, batch: Batch) -> None:
        """The batch's gradient is in: tell the source how far each of its shards is trained."""
        touched = []
        for index, n in batch.ids:
            reading = next((r for r in self.open if r.shard.index == index and n in r.untrained), None)
            if reading is not None:
                reading.untrained.discard(n)
                touched.append(reading)
        for reading in dict.fromkeys(touched):
            self._report(reading)

    def _fill(self) -> None:
        while len(self.buffer) < self.capacity:
            reading = self.open[-1] if self.open and self.open[-1].windows is not None else self._take()
            if reading is None:
                return
            window = next(reading.windows, None)
            if window is None:
                reading.windows = None
                self._report(reading)
                continue
            self.buffer.append(((reading.shard.index, reading.read), window))
            reading.untrained.add(reading.read)
            reading.read += 1
            self.epoch_read = self.epoch_now

    def _take(self) -> _Reading | None:
        got = self.source.next_shard()
        if got is None:
            return None
        shard, start, epoch = got
        self.epoch_now = epoch
        if self.epoch_read is None:
            self.epoch_read = epoch
        if epoch >= self.epoch_read + 2:
            raise ConfigError(
                f"data: no shard holds a training window of {self.seq_len + 1} tokens: "
                "add data, or lower model.seq_len or data.val_fraction"
            )
        docs = _split(shard, self._reader(shard), self.cfg.val_fraction, False)
        wins = islice(windows(docs, self.tokenizer, self.seq_len), start, None)
        reading = _Reading(shard, epoch, wins, read=start, reported=start)
        self.open.append(reading)
        return reading

    def _reader(self, shard: Shard) -> Documents:
        if not 0 <= shard.index < len(self.readers) or self.readers[shard.index][0] != shard:
            raise ConfigError(f"data: shard {shard} is not one of this source's {len(self.readers)} shards")
        return self.readers[shard.index][1]

    def _report(self, reading: _Reading) -> None:
        if reading.windows is None and not reading.untrained:
            self.open.remove(reading)
            self.source.done(reading.shard, reading.epoch)
            return
        low = reading.trained_below()
        if low > reading.reported:
            reading.reported = low
            self.source.progress(reading.shard, reading.epoch, low)

    # -- validation -------------------------------------------------------------------------

    def _first_windows(self, validation: bool, count: int) -> list[torch.Tensor]:
        """The first `count` windows of the training or validation documents, shards in index order."""
        docs = (text for shard, read in self.readers for text in _split(shard, read, self.cfg.val_fraction, validation))
        return list(islice(windows(docs, self.tokenizer, self.seq_len), count))

    def val_batches(self, count: int, size: int) -> list[Batch]:
        """The first count * size windows of the validation documents: the same at every call, in every process."""
        need, width = count * size, self.seq_len + 1
        if self._val is None or len(self._val) < need:
            self._val = self._first_windows(True, need)
        if not self._val:
            raise ConfigError(
                f"data: the validation documents make no window of {width} tokens: add data or raise data.val_fraction"
            )
        rows = self._val[:need]
        if len(rows) < need:
            # A small corpus at a long seq_len (the embedded one at 1024 tokens): evenly spaced windows
            # that overlap, over all the validation tokens read, rather than no validation at all.
            flat = torch.cat(rows)
            rows = [flat[s : s + width] for s in torch.linspace(0, len(flat) - width, need).long().tolist()]
        return [
            Batch(w[:, :-1].contiguous(), w[:, 1:].contiguous())
            for w in (torch.stack(rows[i * size : (i + 1) * size]) for i in range(count))
        ]

    def unigram_loss(self) -> float:
        """The baseline a model must beat: cross-entropy (nats per token) of the validation documents
        under the training documents' token frequencies (add-one smoothed), i.e. a model that ignores
        context. Both over a bounded sample: the first UNIGRAM_*_TOKENS of each."""
        width = self.seq_len + 1
        train = self._first_windows(False, max(UNIGRAM_TRAIN_TOKENS // width, 1))
        val = self._first_windows(True, max(UNIGRAM_VAL_TOKENS // width, 1))
        if not train or not val:
            raise ConfigError(f"data: too little text for one training and one validation window of {width} tokens")
        train, val = torch.cat(train), torch.cat(val)
        counts = torch.bincount(train, minlength=self.tokenizer.vocab_size).double() + 1.0
        logp = (counts / counts.sum()).log()
        return float(-logp[val].mean())
