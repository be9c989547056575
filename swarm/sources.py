"""Where the training text comes from: a source cut into shards, each read lazily as documents.

A shard is the unit one trainer reads (and, with leases, the unit trainers hand between them).
Sources and their shards, in a fixed order that every process computes alike:
- the embedded corpus (CPython's documentation topics): EMBEDDED_SHARDS shards of its sorted topics;
- text files (TEXT_SUFFIXES) and `.jsonl` files: byte ranges of about a TARGET_SHARDS-th of all
  their bytes, clamped to [SHARD_BYTES_MIN, SHARD_BYTES_MAX], so that one big file still makes a
  few shards and a large corpus makes shards of at most 64 MiB; a range owns the lines that start
  in it (the line crossing its start belongs to the range before);
- `.parquet` files: one shard per row group;
- a Hugging Face dataset, opened with `streaming=True`: the dataset's own shards.

Documents: a paragraph of text (lines up to a blank line, cut at DOC_BYTES), a `.jsonl` line's
`text_field`, a parquet row's or a dataset example's `text_field`. Nothing is read whole: files
are read a line (at most LINE_BYTES) or a parquet batch at a time.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from swarm.config import ConfigError, DataConfig

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".json", ".csv", ".html", ".tex"}
FILE_SUFFIXES = TEXT_SUFFIXES | {".jsonl", ".parquet"}
EMBEDDED_SHARDS = 8
TARGET_SHARDS = 8
SHARD_BYTES_MIN = 1 << 20
SHARD_BYTES_MAX = 64 << 20
DOC_BYTES = 64 << 10  # a paragraph longer than this is cut: a file without blank lines stays bounded
LINE_BYTES = 64 << 10  # text lines are read in pieces of at most this
JSON_LINE_BYTES = 16 << 20  # a longer .jsonl line is refused rather than read whole
PARQUET_ROWS = 1024  # rows per record batch read from a row group

Documents = Callable[[], Iterator[str]]  # a fresh lazy pass over one shard's documents


@dataclass(frozen=True)
class Shard:
    index: int  # its position in `shards(cfg)`
    name: str  # a file's path under data.path, "path:k/n" (the k-th of its n pieces), "embedded:i", "hf:i/n"


def shards(cfg: DataConfig) -> list[Shard]:
    """The source's shards, in the same order in every process."""
    return [shard for shard, _ in readers(cfg)]


def readers(cfg: DataConfig) -> list[tuple[Shard, Documents]]:
    """Each shard of the source with the function that streams its documents."""
    if cfg.source == "embedded":
        parts = _embedded_parts()
    elif cfg.source == "files":
        parts = _file_parts(cfg.path or "", cfg.text_field)
    else:
        parts = _huggingface_parts(cfg)
    return [(Shard(i, name), read) for i, (name, read) in enumerate(parts)]


# -- the embedded corpus ----------------------------------------------------------------------


def _embedded_parts() -> list[tuple[str, Documents]]:
    from pydoc_data import topics

    keys = sorted(topics.topics)
    cuts = [len(keys) * k // EMBEDDED_SHARDS for k in range(EMBEDDED_SHARDS + 1)]
    return [
        (f"embedded:{k}", partial(_embedded_documents, tuple(keys[cuts[k] : cuts[k + 1]])))
        for k in range(EMBEDDED_SHARDS)
    ]


def _embedded_documents(keys: tuple[str, ...]) -> Iterator[str]:
    from pydoc_data import topics

    for key in keys:
        yield from paragraphs(line.encode() for line in topics.topics[key].splitlines(keepends=True))


# -- files --------------------------------------------------------------------------------------


def _file_parts(path: str, field: str) -> list[tuple[str, Documents]]:
    files = _files(path)
    root = Path(path)
    # Shards are named relative to data.path, so that machines holding the data at different places
    # agree on the names: the held-out split hashes them and the coordinator leases shards by them.
    label = {f: (f.relative_to(root) if root.is_dir() else Path(f.name)).as_posix() for f in files}
    lined = [f for f in files if f.suffix.lower() != ".parquet"]
    total = sum(f.stat().st_size for f in lined)
    piece = min(max(total // TARGET_SHARDS, SHARD_BYTES_MIN), SHARD_BYTES_MAX)
    parts: list[tuple[str, Documents]] = []
    for f in files:
        suffix = f.suffix.lower()
        if suffix == ".parquet":
            parts += _parquet_parts(f, label[f], field)
            continue
        read = partial(_jsonl_documents, field=field) if suffix == ".jsonl" else _text_documents
        ranges = _byte_ranges(f.stat().st_size, piece)
        for k, (start, end) in enumerate(ranges):
            name = label[f] if len(ranges) == 1 else f"{label[f]}:{k}/{len(ranges)}"
            parts.append((name, partial(read, f, start, end)))
    return parts


def _files(path: str) -> list[Path]:
    root = Path(path)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise ConfigError(f"data.path: {path} does not exist")
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in FILE_SUFFIXES)
    if not files:
        raise ConfigError(f"data.path: no data files ({', '.join(sorted(FILE_SUFFIXES))}) under {path}")
    return files


def _byte_ranges(size: int, piece: int) -> list[tuple[int, int]]:
    n = max(1, -(-size // piece))
    return [(size * k // n, size * (k + 1) // n) for k in range(n)]


def _lines(path: Path, start: int, end: int, limit: int) -> Iterator[tuple[int, bytes]]:
    """(byte offset, piece) for the lines that start in [start, end), in pieces of at most `limit`
    bytes (a piece without its newline continues in the next)."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - the generator's life is the file's
    except OSError as e:
        raise ConfigError(f"data.path: cannot read {path} ({e.strerror})") from None
    with f:
        if start:
            f.seek(start - 1)
            while (skipped := f.readline(limit)) and not skipped.endswith(b"\n"):
                pass  # the rest of the line that the range before owns
        pos = f.tell()
        whole = True
        while pos < end or not whole:
            piece = f.readline(limit)
            if not piece:
                return
            yield pos, piece
            pos += len(piece)
            whole = piece.endswith(b"\n")


def paragraphs(lines: Iterable[bytes]) -> Iterator[str]:
    """Lines up to a blank line as one document (at most about DOC_BYTES; longer ones are cut)."""
    doc: list[bytes] = []
    size = 0
    for line in lines:
        if line.strip():
            doc.append(line)
            size += len(line)
        if doc and (size >= DOC_BYTES or not line.strip()):
            yield b"".join(doc).decode("utf-8", errors="replace").rstrip("\r\n")
            doc, size = [], 0
    if doc:
        yield b"".join(doc).decode("utf-8", errors="replace").rstrip("\r\n")


def _text_documents(path: Path, start: int, end: int) -> Iterator[str]:
    return paragraphs(piece for _, piece in _lines(path, start, end, LINE_BYTES))


def _jsonl_documents(path: Path, start: int, end: int, field: str) -> Iterator[str]:
    for offset, line in _lines(path, start, end, JSON_LINE_BYTES):
        where = f"data.path: {path}, line at byte {offset}"
        if not line.endswith(b"\n") and len(line) == JSON_LINE_BYTES:
            raise ConfigError(f"{where}: longer than {JSON_LINE_BYTES >> 20} MiB")
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"{where}: not valid JSON ({e})") from None
        yield text_of(record, field, where)


def text_of(record: object, field: str, where: str) -> str:
    """The `field` of one record, which must be a string."""
    if not isinstance(record, dict) or field not in record:
        raise ConfigError(f"{where}: no {field!r} field (data.text_field)")
    text = record[field]
    if not isinstance(text, str):
        raise ConfigError(f"{where}: {field!r} is a {type(text).__name__}, not text")
    return text


def _parquet_parts(path: Path, label: str, field: str) -> list[tuple[str, Documents]]:
    pa, pq = _pyarrow()
    try:
        meta = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise ConfigError(f"data.path: {path} is not a readable parquet file ({e})") from None
    schema = meta.schema_arrow
    if field not in schema.names:
        raise ConfigError(f"data.text_field: {field!r} is not a column of {path} (columns: {schema.names})")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ConfigError(f"data.text_field: column {field!r} of {path} holds {kind}, not text")
    n = meta.num_row_groups
    return [(label if n == 1 else f"{label}:{g}/{n}", partial(_parquet_documents, path, g, field)) for g in range(n)]


def _parquet_documents(path: Path, group: int, field: str) -> Iterator[str]:
    _, pq = _pyarrow()
    for batch in pq.ParquetFile(path).iter_batches(batch_size=PARQUET_ROWS, row_groups=[group], columns=[field]):
        yield from (text for text in batch.column(0).to_pylist() if text is not None)


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("data.path: reading .parquet files needs pyarrow (pip install pyarrow)") from None
    return pa, pq


# -- Hugging Face datasets ----------------------------------------------------------------------


def _huggingface_parts(cfg: DataConfig) -> list[tuple[str, Documents]]:
    try:
        import datasets
    except ImportError:
        raise ConfigError("data.source: 'huggingface' needs the datasets package (pip install datasets)") from None
    try:
        ds = datasets.load_dataset(
            cfg.dataset, cfg.dataset_config, data_files=cfg.data_files, split=cfg.split, streaming=True
        )
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"data.dataset: cannot open {cfg.dataset!r} ({e})") from None
    n = ds.n_shards
    return [(f"hf:{i}/{n}", partial(_huggingface_documents, ds, i, n, cfg.text_field)) for i in range(n)]


def _huggingface_documents(ds, index: int, count: int, field: str) -> Iterator[str]:
    for row, record in enumerate(ds.shard(num_shards=count, index=index)):
        yield text_of(record, field, f"data.dataset: shard {index}/{count}, example {row}")
