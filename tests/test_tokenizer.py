"""Tokenizers: the byte tokenizer or a trained byte-level BPE, named by `[data] tokenizer`, and the
tokenizer travelling with the run: a real coordinator serves it, every joiner downloads it, checks
its sha256 and keeps it in its cache (a damaged copy is replaced; a copy that does not match the
join answer is refused)."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import torch

from swarm.config import ConfigError, RunConfig, dump_config, load_config
from swarm.data import TrainStream
from swarm.join import fetch_join, tokenizer_cache
from swarm.tokenizer import EOS, ByteTokenizer, HFTokenizer, load_tokenizer, train_tokenizer
from tests.conftest import CONFIGS, run_cli
from tests.processes import start_coordinator
from tests.test_hostile_coordinator import HostileCoordinator

TINY = CONFIGS / "tiny.toml"
TEXT = "def main():\n    print('héllo, wörld ☃')  # SWARM\n\t\x00 日本語のテキスト  "


def documents() -> list[str]:
    """A small corpus: CPython's documentation topics, one document each."""
    from pydoc_data import topics

    return [topics.topics[key] for key in sorted(topics.topics)[:60]]


def tokenizer_run(tmp: Path, vocab_size: int = 400, extra: str = "") -> tuple[Path, HFTokenizer]:
    """tiny.toml with a byte-level BPE trained on `documents()` as its tokenizer (named relative to
    the config file) and no vocab_size of its own; `extra`: more TOML at the end."""
    tok = train_tokenizer(documents(), vocab_size, tmp / "tokenizer.json")
    config = tmp / "run.toml"
    config.write_text(TINY.read_text().replace("vocab_size = 256\n", "") + 'tokenizer = "tokenizer.json"\n' + extra)
    return config, tok


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """This test's tokenizer cache (joiners started from it inherit it)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert tokenizer_cache() == tmp_path / "cache" / "swarm" / "tokenizers"
    return tokenizer_cache()


# -- the tokenizers --------------------------------------------------------------------------


def test_a_trained_tokenizer_round_trips_text_and_has_an_end_of_document_token(tmp_path):
    tok = train_tokenizer(documents(), 300, tmp_path / "tok.json")
    assert tok.vocab_size == 300 and tok.eos_id is not None and tok.eos_token == EOS
    assert tok.digest == hashlib.sha256((tmp_path / "tok.json").read_bytes()).hexdigest()
    ids = tok.encode(TEXT)
    assert ids.dtype == torch.long and ids.dim() == 1 and int(ids.max()) < 300
    assert tok.decode(ids) == TEXT
    assert len(ids) < len(TEXT.encode())  # merges: fewer tokens than bytes
    again = load_tokenizer(str(tmp_path / "tok.json"))
    assert again.digest == tok.digest and torch.equal(again.encode(TEXT), ids)


def test_the_byte_tokenizer_is_the_default_and_has_no_file():
    tok = load_tokenizer("bytes")
    assert isinstance(tok, ByteTokenizer)
    assert (tok.vocab_size, tok.digest, tok.eos_id) == (256, "bytes", None)
    assert tok.encode("é").tolist() == [0xC3, 0xA9] and tok.decode(tok.encode(TEXT)) == TEXT
    assert load_config(TINY).data.tokenizer == "bytes"


def test_a_missing_or_broken_tokenizer_file_is_refused_naming_it(tmp_path):
    with pytest.raises(ConfigError, match=f"{tmp_path / 'missing.json'}: cannot read the tokenizer"):
        load_tokenizer(str(tmp_path / "missing.json"))
    broken = tmp_path / "broken.json"
    broken.write_text('{"model": "not one"}')
    with pytest.raises(ConfigError, match=f"{broken}: not a tokenizer.json the tokenizers package can read"):
        load_tokenizer(str(broken))


def test_the_token_stream_uses_the_runs_tokenizer(tmp_path):
    config, tok = tokenizer_run(tmp_path)
    run = load_config(config)
    stream = TrainStream.local(run.data, run.model.seq_len, run.training.seed)
    assert stream.tokenizer.digest == tok.digest
    batch = stream.next_microbatch(8)
    assert int(batch.inputs.max()) < tok.vocab_size
    assert (batch.inputs == tok.eos_id).any()  # documents are separated by the end-of-document token
    assert stream.unigram_loss() < torch.log(torch.tensor(float(tok.vocab_size)))


# -- the config ------------------------------------------------------------------------------


def test_the_model_vocabulary_follows_the_tokenizer_named_relative_to_the_config(tmp_path):
    config, tok = tokenizer_run(tmp_path)
    run = load_config(config)
    assert run.data.tokenizer == str(tmp_path / "tokenizer.json")
    assert run.model.vocab_size == tok.vocab_size == 400
    dumped = tmp_path / "elsewhere" / "run.toml"
    dumped.parent.mkdir()
    dumped.write_text(dump_config(run))
    assert load_config(dumped) == run  # an absolute path reads back the same from anywhere
    assert run.with_data(str(TINY)).data.tokenizer == run.data.tokenizer  # a trainer's --data keeps it


def test_a_vocab_size_that_differs_from_the_tokenizers_is_refused_with_both_numbers(tmp_path):
    config, _ = tokenizer_run(tmp_path)
    config.write_text(config.read_text().replace("[model]\n", "[model]\nvocab_size = 256\n"))
    with pytest.raises(ConfigError, match=r"model.vocab_size: 256, but the tokenizer \(.*\) has 400 tokens"):
        load_config(config)
    config.write_text(config.read_text().replace("vocab_size = 256", "vocab_size = 400"))
    assert load_config(config).model.vocab_size == 400


def test_a_config_naming_a_missing_tokenizer_is_refused(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(TINY.read_text() + 'tokenizer = "nowhere/tokenizer.json"\n')
    with pytest.raises(ConfigError) as err:
        load_config(config)
    assert f"{config}: data.tokenizer: {tmp_path / 'nowhere' / 'tokenizer.json'}: cannot read" in str(err.value)


# -- the command line ------------------------------------------------------------------------


def test_swarm_tokenizer_train_writes_a_tokenizer_from_a_folder_of_text_files(processes, tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    for i, doc in enumerate(documents()[:30]):
        (corpus / ("sub" if i % 2 else ".") / f"doc{i}.txt").write_text(doc)
    (corpus / "image.png").write_bytes(b"\x89PNG not text")
    out = tmp_path / "tok.json"
    done = run_cli("tokenizer", "train", "--data", str(corpus), "--vocab-size", "350", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"vocab size 350: wrote {out} in" in done.stdout
    tok = load_tokenizer(str(out))
    assert tok.vocab_size == 350 and tok.decode(tok.encode(TEXT)) == TEXT


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--vocab-size", "256"], "--vocab-size: 256 must be between 257"),
        (["--vocab-size", "5000000"], "--vocab-size: 5000000 must be between 257 (256 bytes + <|endoftext|>) and"),
        (["--vocab-size", "many"], "--vocab-size: 'many' is not an integer"),
        (["--data", "{tmp}/nothing"], "--data: {tmp}/nothing does not exist"),
        (["--data", "{tmp}/empty"], "--data: no data files (.csv, .html, .json, .jsonl, .md, .parquet,"),
        (["--out", "{tmp}/no/folder/tok.json"], "--out: {tmp}/no/folder/tok.json: the folder {tmp}/no/folder does not"),
        (["--out", "{tmp}"], "--out: {tmp}: a folder, not a file"),
    ],
)
def test_swarm_tokenizer_train_refuses_bad_arguments_naming_them(processes, tmp_path, args, message):
    (tmp_path / "empty").mkdir()
    given = {"--data": str(TINY), "--vocab-size": "300", "--out": str(tmp_path / "tok.json")}
    given.update(zip(args[::2], (a.format(tmp=tmp_path) for a in args[1::2]), strict=True))
    done = run_cli("tokenizer", "train", *(x for pair in given.items() for x in pair))
    assert done.returncode == 2 and message.format(tmp=tmp_path) in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "tok.json").exists()


# -- the tokenizer travels with the run ------------------------------------------------------


def test_a_joiner_gets_the_runs_tokenizer_from_a_real_coordinator_and_caches_it(processes, tmp_path, cache, caplog):
    config, tok = tokenizer_run(tmp_path)
    coordinator, url = start_coordinator(config, tmp_path / "coordinator.log", "--join-token", "sesame")
    try:
        refused = httpx.get(f"{url}/api/v1/tokenizer", timeout=10)
        assert refused.status_code == 401  # the join endpoint's rule
        answer = httpx.get(f"{url}/api/v1/join", headers={"Authorization": "Bearer sesame"}, timeout=10).json()
        assert answer["tokenizer_sha256"] == tok.digest

        run, _ = fetch_join(url, join_token="sesame")
        copy = cache / f"{tok.digest}.json"
        assert run.data.tokenizer == str(copy) and copy.read_bytes() == tok.data
        joined = load_tokenizer(run.data.tokenizer)
        assert (joined.digest, joined.vocab_size, run.model.vocab_size) == (tok.digest, 400, 400)
        assert torch.equal(joined.encode(TEXT), tok.encode(TEXT))

        copy.write_bytes(copy.read_bytes().replace(b'"merges"', b'"merged"'))  # damaged on disk
        with caplog.at_level(logging.WARNING, logger="swarm.join"):
            run, _ = fetch_join(url, join_token="sesame")
        assert f"the cached tokenizer {copy} is damaged" in caplog.text
        assert copy.read_bytes() == tok.data and load_tokenizer(run.data.tokenizer).digest == tok.digest
        assert sorted(p.name for p in cache.iterdir()) == [copy.name]  # no temporary file left
    finally:
        coordinator.stop()


class LyingCoordinator(HostileCoordinator):
    """Answers /api/v1/join for a run with a tokenizer, and serves another file than the one it hashed."""

    config: dict
    digest: str
    served: bytes

    def body(self) -> bytes:
        if self.path == "/api/v1/join":
            return json.dumps({"config": self.config, "initial_peers": [], "tokenizer_sha256": self.digest}).encode()
        return self.served


def lying(config: dict, digest: str, served: bytes) -> tuple[ThreadingHTTPServer, str]:
    handler = type("Handler", (LyingCoordinator,), {"config": config, "digest": digest, "served": served})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_a_tokenizer_that_does_not_match_the_join_answers_hash_is_refused_and_not_kept(tmp_path, cache):
    config, tok = tokenizer_run(tmp_path)
    other = train_tokenizer(documents(), 350, tmp_path / "other.json")
    assert other.digest != tok.digest
    server, url = lying(load_config(config).model_dump(), tok.digest, other.data)
    try:
        with pytest.raises(ConfigError) as err:
            fetch_join(url)
    finally:
        server.shutdown()
    assert f"has sha256 {other.digest}, not the {tok.digest} of the join answer: not used" in str(err.value)
    assert not cache.exists() or not list(cache.iterdir())


@pytest.mark.parametrize(
    ("tokenizer", "digest", "message"),
    [
        ("/etc/passwd", None, "names the tokenizer /etc/passwd but serves none"),
        ("bytes", "../../../../tmp/evil", "gave '../../../../tmp/evil' as the tokenizer's sha256"),
    ],
)
def test_a_joiner_reads_no_path_the_coordinator_names(tmp_path, cache, tokenizer, digest, message):
    config = RunConfig(run_id="x").model_dump()
    config["data"]["tokenizer"] = tokenizer
    server, url = lying(config, digest, b"{}")
    try:
        with pytest.raises(ConfigError, match=message):
            fetch_join(url)
    finally:
        server.shutdown()
    assert not (tmp_path / "cache").exists()
