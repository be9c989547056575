"""A run configuration is typed; every malformed file is refused with the field named."""

import tomllib

import pytest

from swarm.config import ConfigError, config_reference, dump_config, load_config, parse_config
from swarm.demo import DEFAULT_CONFIG
from tests.conftest import CONFIGS, run_cli


def tiny() -> dict:
    return tomllib.loads((CONFIGS / "tiny.toml").read_text())


def refused(data: dict) -> str:
    with pytest.raises(ConfigError) as err:
        parse_config(data, "run.toml")
    return str(err.value)


@pytest.mark.parametrize("name", ["tiny", "small", "125m", "1b"])
def test_shipped_configs_load(name):
    run = load_config(CONFIGS / f"{name}.toml")
    covered = [i for k in range(run.stages.count) for i in run.stage_layers(k)]
    assert covered == list(range(run.model.n_layers))


@pytest.mark.parametrize("path", [*(CONFIGS / f"{n}.toml" for n in ["tiny", "small", "125m", "1b"]), DEFAULT_CONFIG])
def test_a_dumped_config_reads_back_equal(path):
    run = load_config(path)
    assert parse_config(tomllib.loads(dump_config(run))) == run
    changed = run.with_stages(1)  # lists and None are written too
    assert parse_config(tomllib.loads(dump_config(changed))) == changed


def test_coordinator_stages_option_is_validated(processes):
    result = run_cli("coordinator", "--config", str(CONFIGS / "tiny.toml"), "--stages", "9")
    assert result.returncode == 2 and "stages.count: 9 stages but only 4 layers" in result.stderr


@pytest.mark.parametrize(
    "mutate, field, phrase",
    [
        (lambda d: d["model"].update(n_layer=4), "model.n_layer", "unknown key"),
        (lambda d: d.update(extra_section={}), "extra_section", "unknown key"),
        (lambda d: d["model"].update(d_model="128"), "model.d_model", "integer"),
        (lambda d: d["training"].update(lr="fast"), "training.lr", "number"),
        (lambda d: d["model"].update(n_heads=5), "model.n_heads", "must divide d_model"),
        (lambda d: d["model"].update(n_kv_heads=3), "model.n_kv_heads", "must divide n_heads"),
        (lambda d: d["stages"].update(count=5), "stages.count", "only 4 layers"),
        (lambda d: d["stages"].update(layers=[3, 3]), "stages.layers", "sums to 6"),
        (lambda d: d["stages"].update(layers=[4]), "stages.layers", "1 entries"),
        (lambda d: d["training"].update(micro_batch=5), "training.global_batch", "multiple of micro_batch"),
        (lambda d: d["training"].update(lr=-1.0), "training.lr", "greater than 0"),
        (lambda d: d["wire"].update(codec="zip"), "wire.codec", "'none', 'fp16', 'bf16' or 'int8'"),
        (
            lambda d: d.setdefault("averaging", {}).update(compression="topk"),
            "averaging.compression",
            "'none', 'fp16', 'int8', 'int4' or 'powersgd'",
        ),
        (lambda d: d.setdefault("averaging", {}).update(compression="powersgd", rank=0), "averaging.rank", "1"),
        (lambda d: d.setdefault("averaging", {}).update(paths="sticky"), "averaging.paths", "'routed' or 'pinned'"),
        (lambda d: d["model"].update(tie_embeddings=True), "model.tie_embeddings", "stages.count = 1"),
        (lambda d: d["data"].update(source="files"), "data.path", "required"),
        (lambda d: d.update(run_id="has space"), "run_id", "letters, digits and . _ - only"),
        (lambda d: d.update(run_id=".."), "run_id", "not starting with '.'"),
        (lambda d: d.update(run_id=".hidden"), "run_id", "not starting with '.'"),
        (lambda d: d.update(run_id="a/b"), "run_id", "letters, digits and . _ - only"),
    ],
)
def test_malformed_config_is_refused_with_the_field_named(mutate, field, phrase):
    data = tiny()
    mutate(data)
    message = refused(data)
    assert f"run.toml: {field}:" in message
    assert phrase in message


def test_unreadable_and_invalid_toml_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\nd_model = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_cli_prints_the_message_not_a_traceback(processes, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text((CONFIGS / "tiny.toml").read_text().replace("n_heads = 4", "n_heads = 3"))
    result = run_cli("train", "--local", "--config", str(bad), "--steps", "1")
    assert result.returncode == 2
    assert "model.n_heads: 3 must divide d_model (128)" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_refuses_bad_arguments_clearly(processes):
    result = run_cli("train", "--local", "--config", str(CONFIGS / "tiny.toml"), "--steps", "zero")
    assert result.returncode == 2 and "--steps: 'zero' is not an integer" in result.stderr
    result = run_cli("train", "--local", "--config", str(CONFIGS / "tiny.toml"), "--steps", "1", "--device", "tpu")
    assert result.returncode == 2 and "--device: 'tpu' is not one of" in result.stderr
    assert "Traceback" not in result.stderr


def test_help_lists_subcommands(processes):
    result = run_cli("--help")
    assert result.returncode == 0 and "train" in result.stdout
    result = run_cli("train", "--help")
    assert result.returncode == 0 and "--log-json" in result.stdout


def test_the_readme_lists_every_option_as_the_models_define_them():
    reference = (CONFIGS.parent / "docs" / "configuration.md").read_text()
    start, end = "<!-- config reference: start -->\n", "<!-- config reference: end -->"
    listed = reference[reference.index(start) + len(start) : reference.index(end)]
    assert listed == config_reference(), "docs/configuration.md's configuration reference is out of date"
