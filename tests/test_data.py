"""Data: sources streamed shard by shard into token windows; a held-out split by document."""

import json
import re
import subprocess
import sys
from collections import Counter

import pytest
import torch

from benchmarks.data import measure
from swarm.config import ConfigError, DataConfig
from swarm.data import ByteTokenizer, DataExhausted, LocalShards, Shard, TrainStream, is_validation, shards
from swarm.sources import DOC_BYTES, readers
from tests.conftest import ROOT

TOK = ByteTokenizer()


def documents(cfg: DataConfig) -> list[str]:
    return [doc for _, read in readers(cfg) for doc in read()]


def numbered(n: int) -> list[str]:
    """Documents that say which they are: <i> repeated, so that any window shows its documents."""
    return [f"<{i}> " * (5 + i % 7) for i in range(n)]


def marks(batch) -> set[int]:
    """The documents whose marks the batch's windows show."""
    return {int(m) for row in batch.inputs for m in re.findall(r"<(\d+)>", TOK.decode(row))}


def drain(data: TrainStream, size: int = 8) -> list[tuple[int, int]]:
    """Every id of the first epoch's windows that come out before the source starts its second epoch."""
    ids = []
    while data.source.epoch <= 0:  # -1 before the first shard
        batch = data.next_microbatch(size)
        data.trained(batch)
        ids += batch.ids
    return ids


class Fixed:
    """A ShardSource that hands out the given (shard, start, epoch) once each, then nothing."""

    def __init__(self, given):
        self.given, self.progressed, self.finished = list(given), [], []

    def next_shard(self):
        return self.given.pop(0) if self.given else None

    def progress(self, shard, epoch, offset):
        self.progressed.append((shard.index, offset))

    def done(self, shard, epoch):
        self.finished.append(shard.index)


def test_tokenizer_round_trips_any_text():
    text = "def f(x):\n    return x ** 2  # ünïcødé ✓"
    ids = TOK.encode(text)
    assert ids.dtype == torch.long and int(ids.max()) < 256
    assert TOK.decode(ids) == text


def test_the_embedded_corpus_streams_as_a_few_shards_of_windows():
    cfg = DataConfig()
    assert shards(cfg) == [Shard(i, f"embedded:{i}") for i in range(8)]
    assert len("\n\n".join(documents(cfg))) > 200_000
    data = TrainStream.local(cfg, seq_len=64, seed=0, tokenizer=TOK)
    b = data.next_microbatch(4)
    assert b.inputs.shape == b.targets.shape == (4, 64)
    assert torch.equal(b.inputs[:, 1:], b.targets[:, :-1])
    assert len(b.ids) == 4 and all(0 <= s < 8 and n >= 0 for s, n in b.ids)
    assert 1.0 < data.unigram_loss() < torch.log(torch.tensor(256.0)).item()


def test_text_files_and_folders_read_by_suffix(tmp_path):
    (tmp_path / "a.txt").write_text("hello there\nsecond line\n\n\nworld\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("# title\n\nbody")
    (tmp_path / "skip.bin").write_bytes(b"\x00\x01")
    cfg = DataConfig(source="files", path=str(tmp_path))
    assert [s.name for s in shards(cfg)] == ["a.txt", "sub/b.md"]
    assert documents(cfg) == ["hello there\nsecond line", "world", "# title", "body"]
    assert documents(cfg.model_copy(update={"path": str(tmp_path / "sub" / "b.md")})) == ["# title", "body"]


def test_a_big_text_file_is_cut_into_byte_ranges_that_share_out_its_lines(tmp_path):
    expected = [f"paragraph {i}\n" + "x" * (1 + i % 300) for i in range(40_000)]
    long_line = "y" * (3 * DOC_BYTES + 5)  # no newline in it: read in pieces, cut into documents
    path = tmp_path / "big.txt"
    path.write_text("\n\n".join(expected) + "\n\n" + long_line)
    cfg = DataConfig(source="files", path=str(path))
    names = [s.name for s in shards(cfg)]
    assert len(names) == 7 and names[3] == "big.txt:3/7"  # 6.8 MB: in ranges of at least 1 MiB
    docs = documents(cfg)
    assert docs[: len(expected)] == expected
    assert "".join(docs[len(expected) :]) == long_line and all(len(d) <= DOC_BYTES for d in docs)


def test_jsonl_parquet_and_huggingface_streaming_sources(processes, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    texts = numbered(50)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"body": t, "n": i}) + "\n" for i, t in enumerate(texts)))
    pq.write_table(pa.table({"body": texts[:30]}), tmp_path / "b.parquet", row_group_size=10)
    cfg = DataConfig(source="files", path=str(tmp_path), text_field="body")
    assert [s.name for s in shards(cfg)] == ["a.jsonl"] + [f"b.parquet:{g}/3" for g in range(3)]
    assert documents(cfg) == texts + texts[:30]

    hf = DataConfig(source="huggingface", dataset="json", data_files=[str(tmp_path / "a.jsonl")] * 2, text_field="body")
    assert [s.name for s in shards(hf)] == ["hf:0/2", "hf:1/2"]
    assert documents(hf) == texts + texts
    data = TrainStream.local(hf, seq_len=16, seed=0, tokenizer=TOK)
    assert data.next_microbatch(2).inputs.shape == (2, 16)


def test_training_windows_never_hold_a_validation_document(tmp_path):
    texts = numbered(3000)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = DataConfig(source="files", path=str(tmp_path), val_fraction=0.1)
    shard = shards(cfg)[0]
    held = {i for i in range(len(texts)) if is_validation(shard, i, 0.1)}
    assert 200 < len(held) < 400
    data = TrainStream.local(cfg, seq_len=32, seed=0, tokenizer=TOK)
    trained = set()
    for _ in range(100):
        trained |= marks(data.next_microbatch(16))
    assert len(trained) > 1000 and not trained & held
    val = data.val_batches(count=3, size=4)
    seen = set().union(*(marks(b) for b in val))
    assert seen and seen <= held


def test_an_epoch_gives_each_window_once_and_the_seed_decides_the_order(tmp_path):
    for k in range(3):
        (tmp_path / f"{k}.txt").write_text("\n\n".join(numbered(400)))
    cfg = DataConfig(source="files", path=str(tmp_path))

    def stream(seed):
        return TrainStream(cfg, 32, seed, TOK, LocalShards(shards(cfg), seed), buffer=16)

    first = drain(stream(1))
    counts = Counter(first[: len(first) - 16])  # the rest may already be from the second epoch
    assert max(counts.values()) == 1 and len(counts) > 300
    assert {s for s, _ in counts} == {0, 1, 2}
    assert drain(stream(1)) == first
    assert drain(stream(2))[:50] != first[:50]


def test_progress_covers_only_trained_windows_and_a_read_shard_is_done(tmp_path):
    (tmp_path / "a.txt").write_text("\n\n".join(numbered(300)))
    cfg = DataConfig(source="files", path=str(tmp_path))
    (shard,) = shards(cfg)
    source = Fixed([(shard, 5, 0)])
    data = TrainStream(cfg, 32, 0, TOK, source, buffer=8)
    batches = [data.next_microbatch(4) for _ in range(3)]
    assert min(n for b in batches for _, n in b.ids) == 5  # it starts where the source said
    assert source.progressed == []  # drawn is not trained
    low = min(n for _, n in batches[0].ids)
    data.trained(batches[1])
    data.trained(batches[2])
    assert all(offset <= low for _, offset in source.progressed)
    data.trained(batches[0])
    untrained = min(n for (_, n), _ in data.buffer)  # the windows drawn into the buffer, not yet out
    assert source.progressed[-1] == (0, untrained)
    with pytest.raises(DataExhausted):
        while True:
            data.trained(data.next_microbatch(4))
    assert source.finished == [0]


def test_validation_is_the_same_in_every_call_process_and_seed(processes):
    cfg = DataConfig()
    a = TrainStream.local(cfg, 64, 0, TOK).val_batches(2, 4)
    b = TrainStream.local(cfg, 64, 9, TOK).val_batches(2, 4)
    assert all(torch.equal(x.inputs, y.inputs) for x, y in zip(a, b, strict=True))
    code = (
        "from swarm.config import DataConfig; from swarm.data import ByteTokenizer, TrainStream; "
        "val = TrainStream.local(DataConfig(), 64, 3, ByteTokenizer()).val_batches(2, 4); "
        "print([b.inputs.sum().item() for b in val])"
    )
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert child.stdout.strip() == str([x.inputs.sum().item() for x in a])


def test_the_same_files_under_another_folder_give_the_same_shards_and_validation(tmp_path):
    for home in ("here", "there/deeper"):
        (tmp_path / home / "sub").mkdir(parents=True)
        (tmp_path / home / "sub" / "a.txt").write_text("\n\n".join(numbered(400)))
    here, there = (DataConfig(source="files", path=str(tmp_path / home)) for home in ("here", "there/deeper"))
    assert shards(here) == shards(there) == [Shard(0, "sub/a.txt")]
    a, b = (TrainStream.local(cfg, 32, 0, TOK).val_batches(2, 4) for cfg in (here, there))
    assert all(torch.equal(x.inputs, y.inputs) for x, y in zip(a, b, strict=True))
    one_file = DataConfig(source="files", path=str(tmp_path / "here" / "sub" / "a.txt"))
    assert shards(one_file) == [Shard(0, "a.txt")]


def test_streaming_200_mb_keeps_memory_bounded(processes, tmp_path):
    paragraph = (
        "a line of generated text that is about a hundred characters long, written for the test. " * 8 + "\n"
    ) * 16
    with open(tmp_path / "big.txt", "w") as f:
        for _ in range(200_000_000 // len(paragraph)):
            f.write(paragraph + "\n")
    got = measure(tmp_path, seq_len=1024, micro_batch=8)
    assert got["tokens"] > 150_000_000
    assert got["rss_growth_mb"] < 100, got


def test_bad_input_is_refused_with_what_was_wrong(processes, tmp_path):
    def files(**kw):
        return DataConfig(source="files", path=str(tmp_path), **kw)

    with pytest.raises(ConfigError, match="does not exist"):
        shards(files().model_copy(update={"path": str(tmp_path / "nope")}))
    with pytest.raises(ConfigError, match="no data files"):
        shards(files())
    (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n{"text": "cut\n')
    with pytest.raises(ConfigError, match=r"a\.jsonl, line at byte 17: not valid JSON"):
        documents(files())
    (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    with pytest.raises(ConfigError, match="line at byte 17: no 'text' field"):
        documents(files())
    (tmp_path / "a.jsonl").write_text('{"text": 7}\n')
    with pytest.raises(ConfigError, match="'text' is a int, not text"):
        documents(files())
    (tmp_path / "a.jsonl").unlink()
    (tmp_path / "c.parquet").write_text("not parquet")
    with pytest.raises(ConfigError, match="not a readable parquet file"):
        shards(files())
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "c.parquet")
    with pytest.raises(ConfigError, match="'text' is not a column"):
        shards(files())
    with pytest.raises(ConfigError, match="cannot open"):
        shards(DataConfig(source="huggingface", dataset="json", data_files=[str(tmp_path / "none.jsonl")]))
    (tmp_path / "h.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(ConfigError, match="example 0: no 'text' field"):
        documents(DataConfig(source="huggingface", dataset="json", data_files=[str(tmp_path / "h.jsonl")]))


def test_too_little_text_is_refused(tmp_path):
    (tmp_path / "a.txt").write_text("\n\n".join(numbered(40)))
    cfg = DataConfig(source="files", path=str(tmp_path), val_fraction=0.2)  # "a.txt": 5 of the 40 held out
    few = TrainStream.local(cfg, 64, 0, TOK)
    disjoint = few._first_windows(True, 32)
    assert 0 < len(disjoint) < 32  # fewer validation windows than asked: they overlap, evenly spaced
    val = few.val_batches(4, 8)
    assert [b.inputs.shape for b in val] == [(8, 64)] * 4
    assert torch.equal(val[0].inputs[0], disjoint[0][:-1]) and torch.equal(val[-1].targets[-1], disjoint[-1][1:])
    with pytest.raises(ConfigError, match="validation documents make no window"):
        TrainStream.local(cfg, 1024, 0, TOK).val_batches(1, 1)
    with pytest.raises(ConfigError, match="no shard holds a training window"):
        TrainStream.local(cfg, 4096, 0, TOK).next_microbatch(1)
