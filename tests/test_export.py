"""`swarm export` and `swarm generate` against a real swarm: a coordinator, one peer per stage of
configs/tiny.toml and a trainer that runs a few steps first, so the exported weights are trained ones.

The export must load in Hugging Face transformers and give the swarm's logits, computed by the live
peers' Forward RPC stage by stage (tiny.toml's wire codec is none, so the wire is lossless).
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable

import pytest
import torch
from hivemind.utils.crypto import RSAPrivateKey
from transformers import AutoModelForCausalLM, AutoTokenizer

from swarm.client import StageClient
from swarm.config import load_config
from swarm.export import ExportError, export_swarm
from swarm.generate import load_export
from swarm.join import fetch_join, join_run
from swarm.model import Stage
from swarm.tokenizer import EOS, ByteTokenizer, train_tokenizer
from swarm.wire import decode, encode
from tests.conftest import run_cli
from tests.harness import Swarm, peer_record, swarm_fixture
from tests.processes import free_port, start_peer, wait_for_state
from tests.test_averaging import FAST_AVERAGING, config_with
from tests.test_tokenizer import documents, tokenizer_run

STEPS = 3
TEXT = "def main():\n    print('héllo, wörld ☃')  # SWARM\n"


def train_and_export(swarm: Swarm, before_training: Callable[[], None] = lambda: None) -> None:
    """Train `swarm` for STEPS steps with one peer per stage (the trainer then finishes, so the step
    stays put) and export it with the command line (`swarm.out`, `swarm.export`)."""
    swarm.add_peer("p0", 0)
    swarm.add_peer("p1", 1)
    swarm.wait_online(["p0", "p1"])
    before_training()
    swarm.train(steps=STEPS)
    swarm.finish_training()
    wait_for_state(
        swarm.url, lambda s: all(peer_record(s, n)["optimizer_steps"] == STEPS for n in ("p0", "p1")), timeout=30
    )
    swarm.out = swarm.tmp / "model"
    swarm.export = run_cli("export", "--coordinator", swarm.url, "--out", str(swarm.out), timeout=120)


@swarm_fixture(scope="module")
def trained(tmp_path_factory):
    """A swarm of tiny.toml (the byte tokenizer) after STEPS training steps, and its export."""
    tmp = tmp_path_factory.mktemp("export")
    path, _ = config_with(tmp, FAST_AVERAGING)
    swarm = Swarm(tmp, path)
    try:
        train_and_export(swarm)
        yield swarm
    finally:
        swarm.close()


@swarm_fixture(scope="module")
def trained_bpe(tmp_path_factory):
    """The same with a byte-level BPE of 400 tokens trained for the run. The trainer keeps its
    tokenizers in a cache of its own, so the test sees that it fetched the run's."""
    tmp = tmp_path_factory.mktemp("export-bpe")
    config, swarm_tokenizer = tokenizer_run(tmp, extra=FAST_AVERAGING)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("XDG_CACHE_HOME", str(tmp / "peers-cache"))
        swarm = Swarm(tmp, config)
        swarm.tokenizer = swarm_tokenizer
        try:
            train_and_export(swarm, lambda: env.setenv("XDG_CACHE_HOME", str(tmp / "trainer-cache")))
            yield swarm
        finally:
            swarm.close()


def swarm_logits(swarm: Swarm, ids: torch.Tensor) -> torch.Tensor:
    """The logits of the live swarm: the peers' Forward RPC, stage by stage (inference, no targets)."""
    run, _ = fetch_join(swarm.url)
    member = join_run(swarm.url, RSAPrivateKey(), "trainer", run.run_id)  # the peers answer members only
    state = wait_for_state(swarm.url, lambda s: all(peer_record(s, n) for n in ("p0", "p1")))
    x = encode(ids)
    for stage, name in enumerate(["p0", "p1"]):
        record = peer_record(state, name)
        client = StageClient(record["address"], run, member=member, peer_id=record["peer_id"])
        try:
            x = client.forward(stage, x, f"probe-{stage}", step=0, train=False).output
        finally:
            client.close()
    return decode(x)


def probe_ids() -> torch.Tensor:
    text = ByteTokenizer().encode(TEXT * 3)[:128]
    noise = torch.randint(0, 256, (128,), generator=torch.Generator().manual_seed(1))
    return torch.stack([text, noise])


def test_export_loads_in_transformers_and_gives_the_swarms_logits(trained):
    done = trained.export
    assert done.returncode == 0, done.stderr[-3000:]
    for stage in (0, 1):
        assert f"stage {stage}: layers" in done.stdout and f"at step {STEPS} from p{stage}" in done.stdout
    assert f"exported step {STEPS}:" in done.stdout
    meta = json.loads((trained.out / "swarm_export.json").read_text())
    assert meta["step"] == STEPS and [s["public_name"] for s in meta["stages"]] == ["p0", "p1"]

    model = AutoModelForCausalLM.from_pretrained(trained.out, dtype=torch.float32).eval()
    ids = probe_ids()
    with torch.no_grad():
        hf = model(ids).logits
    reference = swarm_logits(trained, ids)
    diff = (hf - reference).abs().max().item()
    print(f"max abs logit difference, transformers vs swarm: {diff:.3g}")
    assert diff <= 1e-4

    # trained weights, not the seeded init
    init = Stage(load_config(trained.config), 0).embed_tokens.weight
    assert not torch.equal(model.model.embed_tokens.weight, init)


def test_our_loader_gives_the_same_logits_as_transformers(trained):
    model = AutoModelForCausalLM.from_pretrained(trained.out, dtype=torch.float32).eval()
    ours, run = load_export(trained.out)
    assert run.model == load_config(trained.config).model
    ids = probe_ids()
    with torch.no_grad():
        assert (ours(ids) - model(ids).logits).abs().max().item() <= 1e-4


def test_the_exported_tokenizer_is_the_byte_tokenizer(trained):
    tok = AutoTokenizer.from_pretrained(trained.out)
    for text in [TEXT, "  leading spaces, a tab\t and \x00 control bytes ", "日本語のテキスト"]:
        ids = tok.encode(text)
        assert ids == ByteTokenizer().encode(text).tolist()
        assert tok.decode(ids) == text


def test_generate_prints_a_continuation(trained):
    done = run_cli(
        "generate", "--model", str(trained.out), "--prompt", "def ", "--max-new-tokens", "40", "--threads", "1"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("def ") and len(done.stdout.encode()) > 40
    assert "40 tokens in" in done.stderr


def test_a_run_with_a_trained_tokenizer_exports_it_and_generates_in_transformers(trained_bpe):
    done = trained_bpe.export
    assert done.returncode == 0, done.stderr[-3000:]
    ours, out = trained_bpe.tokenizer, trained_bpe.out
    fetched = trained_bpe.tmp / "trainer-cache" / "swarm" / "tokenizers" / f"{ours.digest}.json"
    assert fetched.read_bytes() == ours.data  # the trainer took the run's tokenizer from the coordinator
    assert (out / "tokenizer.json").read_bytes() == ours.data

    tok = AutoTokenizer.from_pretrained(out)
    assert (tok.eos_token, tok.eos_token_id) == (EOS, ours.eos_id)
    ids = tok.encode(TEXT)
    assert ids == ours.encode(TEXT).tolist() and tok.decode(ids) == TEXT
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert (model.config.vocab_size, model.config.eos_token_id) == (400, ours.eos_id)
    swarm_model, run = load_export(out)
    with torch.no_grad():
        assert (swarm_model(torch.tensor([ids])) - model(torch.tensor([ids])).logits).abs().max().item() <= 1e-4
    assert run.model.vocab_size == 400

    prompt = tok("def ", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert generated.shape[1] > prompt["input_ids"].shape[1] and int(generated.max()) < 400
    assert tok.decode(generated[0], skip_special_tokens=True).startswith("def ")

    done = run_cli("generate", "--model", str(out), "--prompt", "def ", "--max-new-tokens", "12", "--threads", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("def ") and "vocabulary 400" in done.stderr and " tokens in " in done.stderr


def test_exporting_again_replaces_the_previous_export_and_force_keeps_other_files(trained, tmp_path):
    info = export_swarm(trained.url, trained.out, note=lambda text: None)  # the Python API `swarm demo` calls
    assert (info.step, info.out, set(info.sources)) == (STEPS, trained.out, {0, 1})
    assert "p0" in info.sources[0] and "p1" in info.sources[1]
    assert not [p for p in trained.out.parent.iterdir() if p.name.startswith(".")]  # no temporary left behind

    crowded = tmp_path / "crowded"
    crowded.mkdir()
    (crowded / "notes.txt").write_text("mine")
    refused = run_cli("export", "--coordinator", trained.url, "--out", str(crowded), timeout=120)
    assert refused.returncode == 2
    assert f"--out: {crowded} is not empty" in refused.stderr and "--force" in refused.stderr
    assert sorted(p.name for p in crowded.iterdir()) == ["notes.txt"]
    export_swarm(trained.url, crowded, note=lambda text: None, force=True)
    assert (crowded / "notes.txt").read_text() == "mine" and (crowded / "model.safetensors").is_file()


def test_bad_input_is_refused_with_a_message_naming_it(trained, tmp_path):
    nobody = f"http://127.0.0.1:{free_port()}"
    done = run_cli("export", "--coordinator", nobody, "--out", str(tmp_path / "x"))
    assert done.returncode == 2 and f"cannot reach {nobody}" in done.stderr
    assert not (tmp_path / "x").exists()

    missing = tmp_path / "missing"
    done = run_cli("generate", "--model", str(missing), "--prompt", "a")
    assert done.returncode == 2 and f"--model: {missing} is not a directory" in done.stderr

    done = run_cli("generate", "--model", str(trained.out), "--prompt", "a", "--max-new-tokens", "0")
    assert done.returncode == 2 and "--max-new-tokens: 0 must be at least 1" in done.stderr

    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (broken / name).write_bytes((trained.out / name).read_bytes())
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="model.safetensors: not a readable safetensors file"):
        load_export(broken)

    train_tokenizer(documents(), 300, broken / "tokenizer.json")  # not the model's vocabulary
    with pytest.raises(ValueError, match=r"model.vocab_size: 256, but the tokenizer \(.*\) has 300 tokens"):
        load_export(broken)


def test_parameters_travel_as_raw_float32_under_a_lossy_wire_codec(processes, tmp_path):
    path, run = config_with(tmp_path, "")
    path.write_text(path.read_text().replace('codec = "none"', 'codec = "int8"'))
    run = load_config(path)
    proc, address = start_peer(path, 1, tmp_path)
    client = StageClient(address, run)
    try:
        response = client.parameters(1)
    finally:
        client.close()
        proc.stop()
    assert {p.tensor.codec for p in response.parameters} == {"none"}
    init = dict(Stage(run, 1).named_parameters())
    for p in response.parameters:
        assert torch.equal(decode(p.tensor), init[p.name]), p.name


def test_export_names_a_stage_without_an_online_peer(trained, tmp_path):
    # Last in this file: it takes the swarm's stage 1 away. A peer told to stop announces `leaving`
    # at once; the fixture's teardown waits for it to exit.
    os.killpg(trained.peers["p1"].popen.pid, signal.SIGTERM)
    wait_for_state(trained.url, lambda s: (peer_record(s, "p1") or {}).get("state") != "online", timeout=30)
    with pytest.raises(ExportError, match="stage 1 has no online peer"):
        export_swarm(trained.url, tmp_path / "x", note=lambda text: None)
    assert not (tmp_path / "x").exists()
