"""Text to token ids and back: the byte tokenizer, or a `tokenizers` tokenizer.json of the run's.

`[data] tokenizer` names one of them: "bytes" (vocab 256, id == byte value, nothing to download) or
the path of a tokenizer.json, e.g. one made by `swarm tokenizer train` (a byte-level BPE that
`train_tokenizer` fits to a corpus). Both have the same small interface: `vocab_size`, `encode`,
`decode`, `digest` (what identifies the tokenizer between machines) and `eos_id`.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import torch
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from swarm.config import ConfigError, DataConfig
from swarm.sources import readers

log = logging.getLogger(__name__)

BYTES = "bytes"
EOS = "<|endoftext|>"  # the special token `train_tokenizer` adds (GPT-2's name for it)
# Special tokens that end a document in common tokenizers (GPT-2, Llama 2, Llama 3, Gemma), first match wins.
EOS_NAMES = (EOS, "</s>", "<|end_of_text|>", "<eos>")
MIN_VOCAB = 256 + 1  # the byte alphabet and EOS
MAX_VOCAB = 1_000_000  # beyond the largest vocabularies in use (~260k): a typo, not a plan


class Tokenizer(Protocol):
    vocab_size: int
    digest: str  # sha256 of the tokenizer.json, or "bytes"
    eos_id: int | None  # the end-of-document token, when the tokenizer has one
    eos_token: str | None  # and its text

    def encode(self, text: str) -> torch.Tensor: ...

    def decode(self, ids: torch.Tensor | list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: no vocabulary file, no special tokens, covers any text."""

    vocab_size = 256
    digest = BYTES
    eos_id = None
    eos_token = None

    def encode(self, text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class HFTokenizer:
    """A tokenizer.json of the `tokenizers` package. `data`: the file's bytes, kept so that the
    coordinator serves and an export writes exactly what was hashed."""

    def __init__(self, data: bytes, source: str):
        try:
            self._tok = _HFTokenizer.from_str(data.decode("utf-8"))
        except Exception as err:  # tokenizers raises a bare Exception for a file it cannot read
            raise ConfigError(f"{source}: not a tokenizer.json the tokenizers package can read ({err})") from None
        self.data = data
        self.digest = sha256_hex(data)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        special = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        self.eos_id = next((special[name] for name in EOS_NAMES if name in special), None)
        self.eos_token = self._tok.id_to_token(self.eos_id) if self.eos_id is not None else None

    @classmethod
    def from_file(cls, path: str | Path) -> HFTokenizer:
        try:
            data = Path(path).read_bytes()
        except OSError as err:
            raise ConfigError(f"{path}: cannot read the tokenizer: {err.strerror or err}") from None
        return cls(data, str(path))

    def encode(self, text: str) -> torch.Tensor:
        # No special tokens: a document's end is the data reader's to mark (with eos_id).
        return torch.tensor(self._tok.encode(text, add_special_tokens=False).ids, dtype=torch.long)

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        return self._tok.decode([int(i) for i in ids])


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """The tokenizer `[data] tokenizer` names: "bytes", or the path of a tokenizer.json."""
    return ByteTokenizer() if spec == BYTES else HFTokenizer.from_file(spec)


def train_tokenizer(texts: Iterable[str], vocab_size: int, out: Path, show_progress: bool = False) -> HFTokenizer:
    """A byte-level BPE of at most `vocab_size` tokens fitted to `texts` (documents, read one at a
    time), written to `out` as tokenizer.json. Its vocabulary starts from the 256 byte characters,
    so it encodes any text, and holds the special token EOS; on a small corpus the merges may run
    out before `vocab_size`."""
    check_vocab_size(vocab_size)
    tok = _HFTokenizer(models.BPE())
    # No prefix space: decode(encode(text)) gives the text back exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer)
    data = tok.to_str().encode("utf-8")
    out.write_bytes(data)
    return HFTokenizer(data, str(out))


def check_vocab_size(vocab_size: int) -> None:
    if not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise ConfigError(f"--vocab-size: {vocab_size} must be between {MIN_VOCAB} (256 bytes + {EOS}) and {MAX_VOCAB}")


def train_from_files(path: Path, vocab_size: int, out: Path) -> str:
    """`swarm tokenizer train`: fit a tokenizer to the documents at `path` (text, .jsonl and .parquet
    files, streamed as a run reads them; the trainer shows its progress); the summary line to print."""
    start = time.perf_counter()
    check_vocab_size(vocab_size)  # before the files are listed
    if not path.exists():
        raise ConfigError(f"--data: {path} does not exist")
    try:
        parts = readers(DataConfig(source="files", path=str(path)))  # what a run with this data would read
    except ConfigError as err:  # named as the option that gave the path
        raise ConfigError(str(err).replace("data.path:", "--data:", 1)) from None
    log.info(f"training a byte-level BPE of {vocab_size} tokens on {len(parts)} shards of {path}")
    texts = (text for _, read in parts for text in read())
    tok = train_tokenizer(texts, vocab_size, out, show_progress=True)
    short = tok.vocab_size < vocab_size
    asked = f" (asked for {vocab_size}: the corpus has no more merges)" if short else ""
    return f"vocab size {tok.vocab_size}{asked}: wrote {out} in {time.perf_counter() - start:.1f} s"
