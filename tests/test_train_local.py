"""The reference trainer learns, and reports through --log-json and a summary."""

import json
import math

from tests.conftest import CONFIGS, run_cli


def test_local_trainer_learns_the_embedded_corpus(processes, tmp_path):
    # 40 steps of tiny.toml: loss about 2.6 at the last (chance: ln 256 = 5.55); seeded, one thread.
    steps = 40
    log = tmp_path / "log.jsonl"
    result = run_cli(
        "train",
        "--local",
        "--config",
        str(CONFIGS / "tiny.toml"),
        "--steps",
        str(steps),
        "--log-json",
        str(log),
        "--device",
        "cpu",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(steps))
    for r in records:
        assert {"step", "loss", "tokens", "tokens_per_s", "elapsed_s"} <= r.keys()
    assert abs(records[0]["loss"] - math.log(256)) < 0.3  # starts at chance
    assert records[-1]["loss"] < 3.0
    assert records[-1]["val_loss"] < 3.0
    assert records[-1]["tokens"] == steps * 16 * 128
    assert "summary" in result.stdout and "final val loss" in result.stdout
    assert "loss=" in result.stderr  # the progress bar


def test_data_option_trains_on_the_given_files(processes, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    # documents are paragraphs, and validation is one in twenty of them
    (corpus / "a.txt").write_text("the cat sat on the mat.\n\n" * 2000)
    (corpus / "b.md").write_text("the dog sat on the log.\n\n" * 2000)
    log = tmp_path / "log.jsonl"
    args = ["train", "--local", "--config", str(CONFIGS / "tiny.toml"), "--steps", "30", "--log-json", str(log)]
    result = run_cli(*args, "--data", str(corpus))
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    # two short sentences repeated: far easier than the embedded corpus, whose loss is still near 3 here
    assert records[-1]["val_loss"] < 1.0, records[-1]
    missing = run_cli(*args, "--data", str(tmp_path / "nothing"))
    assert missing.returncode == 2 and "--data: " in missing.stderr and "does not exist" in missing.stderr
