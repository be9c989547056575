"""Data: byte tokens from the embedded corpus, local files or a datasets source; held-out split."""

import pytest
import torch

from swarm.config import ConfigError, DataConfig
from swarm.data import TokenStream, load_text
from swarm.tokenizer import ByteTokenizer


def test_tokenizer_round_trips_any_text():
    tok = ByteTokenizer()
    text = "def f(x):\n    return x ** 2  # ünïcødé ✓"
    ids = tok.encode(text)
    assert ids.dtype == torch.long and int(ids.max()) < 256
    assert tok.decode(ids) == text


def test_embedded_corpus_is_real_text():
    text = load_text(DataConfig())
    assert len(text) > 200_000
    assert "for" in text and "return" in text


def test_stream_splits_train_and_validation_without_overlap():
    tokens = torch.arange(10_000) % 256
    s = TokenStream(tokens, seq_len=32, val_fraction=0.1, seed=0)
    assert len(s.train) == 9_000 and len(s.val) == 1_000
    b = s.microbatch(step=3, index=1, size=4)
    assert b.inputs.shape == b.targets.shape == (4, 32)
    assert torch.equal(b.inputs[:, 1:], b.targets[:, :-1])
    val = s.val_batches(count=2, size=4)
    assert all(v.inputs.shape == (4, 32) for v in val)


def test_microbatches_are_a_pure_function_of_step_and_index():
    tokens = torch.randint(0, 256, (50_000,), generator=torch.Generator().manual_seed(0))
    a = TokenStream(tokens, 64, 0.05, seed=7)
    b = TokenStream(tokens, 64, 0.05, seed=7)
    assert torch.equal(a.microbatch(5, 2, 8).inputs, b.microbatch(5, 2, 8).inputs)
    assert not torch.equal(a.microbatch(5, 2, 8).inputs, a.microbatch(5, 3, 8).inputs)
    other_seed = TokenStream(tokens, 64, 0.05, seed=8)
    assert not torch.equal(a.microbatch(5, 2, 8).inputs, other_seed.microbatch(5, 2, 8).inputs)


def test_local_files_and_folders(tmp_path):
    (tmp_path / "a.txt").write_text("hello " * 100)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("world " * 100)
    (tmp_path / "skip.bin").write_bytes(b"\x00\x01")
    text = load_text(DataConfig(source="files", path=str(tmp_path)))
    assert "hello" in text and "world" in text and "\x00" not in text
    assert load_text(DataConfig(source="files", path=str(tmp_path / "a.txt"))).startswith("hello")
    with pytest.raises(ConfigError, match="does not exist"):
        load_text(DataConfig(source="files", path=str(tmp_path / "nope")))


def test_too_little_text_is_refused():
    with pytest.raises(ConfigError, match="too few"):
        TokenStream(torch.zeros(100, dtype=torch.long), seq_len=64, val_fraction=0.1, seed=0)


def test_huggingface_datasets_source_reads_local_files(tmp_path):
    pytest.importorskip("datasets")
    path = tmp_path / "corpus.txt"
    path.write_text("the quick brown fox\njumps over the lazy dog\n")
    cfg = DataConfig(source="huggingface", dataset="text", data_files=[str(path)])
    text = load_text(cfg)
    assert "quick brown fox" in text and "lazy dog" in text
    with pytest.raises(ConfigError, match="text_field"):
        load_text(cfg.model_copy(update={"text_field": "body"}))
