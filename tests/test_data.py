"""Data: sources streamed shard by shard into token windows; a held-out split by document."""

import torch

from swarm.config import DataConfig
from swarm.data import ByteTokenizer, LocalShards, Shard, TrainStream, shards


def test_tokenizer_round_trips_any_text():
    tok = ByteTokenizer()
    text = "def f(x):\n    return x ** 2  # ünïcødé ✓"
    ids = tok.encode(text)
    assert ids.dtype == torch.long and int(ids.max()) < 256
    assert tok.decode(ids) == text


def test_the_embedded_corpus_streams_as_a_few_shards_of_windows():
    cfg = DataConfig()
    assert shards(cfg) == [Shard(i, f"embedded:{i}") for i in range(8)]
    data = TrainStream.local(cfg, seq_len=64, seed=0, tokenizer=ByteTokenizer())
    b = data.next_microbatch(4)
    assert b.inputs.shape == b.targets.shape == (4, 64)
    assert torch.equal(b.inputs[:, 1:], b.targets[:, :-1])
    assert len(b.ids) == 4 and all(isinstance(s, int) and isinstance(n, int) for s, n in b.ids)
    assert isinstance(data.source, LocalShards)
