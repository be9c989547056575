"""Text in, batches of tokens out.

The run's tokenizer (swarm/tokenizer.py: bytes by default, or a tokenizer.json) turns the text into
one token stream. Sources: the embedded corpus (CPython's own documentation topics, shipped with
every Python install), local text files and folders, or a Hugging Face `datasets` dataset. The last
`val_fraction` of the token stream is held out for validation.

Batches are a pure function of (seed, step, microbatch index): every trainer that shares a config
sees the same data in the same order, whichever process draws it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from swarm.config import ConfigError, DataConfig
from swarm.tokenizer import ByteTokenizer, load_tokenizer

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".json", ".csv", ".html", ".tex"}


def embedded_text() -> str:
    from pydoc_data import topics

    return "\n\n".join(topics.topics[key] for key in sorted(topics.topics))


def files_text(path: str) -> str:
    root = Path(path)
    if root.is_file():
        files = [root]
    elif root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    else:
        raise ConfigError(f"data.path: {path} does not exist")
    if not files:
        raise ConfigError(f"data.path: no text files ({', '.join(sorted(TEXT_SUFFIXES))}) under {path}")
    return "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files)


def huggingface_text(cfg: DataConfig) -> str:
    try:
        import datasets
    except ImportError:
        raise ConfigError("data.source: 'huggingface' needs the datasets package (pip install datasets)") from None
    ds = datasets.load_dataset(cfg.dataset, cfg.dataset_config, data_files=cfg.data_files, split=cfg.split)
    if cfg.text_field not in ds.column_names:
        raise ConfigError(f"data.text_field: {cfg.text_field!r} not in the dataset's columns {ds.column_names}")
    return "\n\n".join(ds[cfg.text_field])


def load_text(cfg: DataConfig) -> str:
    if cfg.source == "embedded":
        return embedded_text()
    if cfg.source == "files":
        return files_text(cfg.path)
    return huggingface_text(cfg)


@dataclass(frozen=True)
class Batch:
    inputs: torch.Tensor  # [B, T] token ids
    targets: torch.Tensor  # [B, T] the next token of each input position


class TokenStream:
    """A train/validation split of one token stream, sampled as random windows of seq_len + 1."""

    def __init__(
        self,
        tokens: torch.Tensor,
        seq_len: int,
        val_fraction: float,
        seed: int,
        vocab_size: int = ByteTokenizer.vocab_size,
    ):
        n_val = max(int(len(tokens) * val_fraction), seq_len + 1)
        if len(tokens) - n_val < seq_len + 1:
            raise ConfigError(f"data: only {len(tokens)} tokens, too few for seq_len {seq_len} with a validation split")
        self.train, self.val = tokens[:-n_val], tokens[-n_val:]
        self.seq_len, self.seed, self.vocab_size = seq_len, seed, vocab_size

    @classmethod
    def from_config(cls, cfg: DataConfig, seq_len: int, seed: int) -> TokenStream:
        tok = load_tokenizer(cfg.tokenizer)
        return cls(tok.encode(load_text(cfg)), seq_len, cfg.val_fraction, seed, tok.vocab_size)

    def _windows(self, tokens: torch.Tensor, starts: torch.Tensor) -> Batch:
        idx = starts[:, None] + torch.arange(self.seq_len + 1)
        win = tokens[idx]
        return Batch(win[:, :-1].contiguous(), win[:, 1:].contiguous())

    def microbatch(self, step: int, index: int, size: int) -> Batch:
        """Training microbatch `index` of optimizer step `step`: deterministic in (seed, step, index)."""
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 1_009 + index)
        starts = torch.randint(0, len(self.train) - self.seq_len, (size,), generator=gen)
        return self._windows(self.train, starts)

    def unigram_loss(self) -> float:
        """The baseline a model must beat: cross-entropy (nats per token) of the validation split under
        the training split's token frequencies (add-one smoothed), i.e. a model that ignores context."""
        counts = torch.bincount(self.train, minlength=self.vocab_size).double() + 1.0
        logp = (counts / counts.sum()).log()
        return float(-logp[self.val].mean())

    def val_batches(self, count: int, size: int) -> list[Batch]:
        """A fixed set of evenly spaced validation windows (the same at every evaluation)."""
        n = count * size
        span = len(self.val) - self.seq_len - 1
        starts = torch.linspace(0, span, n).long()
        return [self._windows(self.val, starts[i * size : (i + 1) * size]) for i in range(count)]
