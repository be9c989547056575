"""The reference trainer learns, and reports through --log-json and a summary."""

import json
import math

from tests.conftest import CONFIGS, run_cli


def test_local_trainer_learns_the_embedded_corpus(tmp_path):
    log = tmp_path / "log.jsonl"
    result = run_cli(
        "train",
        "--local",
        "--config",
        str(CONFIGS / "tiny.toml"),
        "--steps",
        "120",
        "--log-json",
        str(log),
        "--device",
        "cpu",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(120))
    for r in records:
        assert {"step", "loss", "tokens", "tokens_per_s", "elapsed_s"} <= r.keys()
    assert abs(records[0]["loss"] - math.log(256)) < 0.3  # starts at chance
    assert records[-1]["loss"] < 3.0
    assert records[-1]["val_loss"] < 3.0
    assert records[-1]["tokens"] == 120 * 16 * 128
    assert "summary" in result.stdout and "final val loss" in result.stdout
    assert "loss=" in result.stderr  # the progress bar
