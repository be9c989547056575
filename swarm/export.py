"""`swarm export`: gather every stage of a live swarm into one Hugging Face Llama checkpoint.

For each stage, the online peer with the most optimizer steps hands over its weights through the
`Parameters` RPC (raw float32, whatever the run's wire codec); another peer of the stage is tried
when one fails. The stages must all be at the same optimizer step: a step in progress is waited out
by reading the stages that lag again, and an export that still mixes steps at the deadline is refused.

The directory holds what `transformers.AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` read: `model.safetensors` (the stage's parameter names behind
`model.`, as in HF's `LlamaForCausalLM`), `config.json`, `generation_config.json`, the run's
tokenizer (`tokenizer.json` and friends: the run's own file, or for the byte tokenizer one whose
id == byte value), and `swarm_export.json` (run, step and source peers). Nothing here imports
transformers (not a dependency of swarm): the files are written as the plain JSON it reads.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import torch
from hivemind.utils.crypto import RSAPrivateKey
from pydantic import BaseModel, ConfigDict, ValidationError
from safetensors.torch import save_file

from swarm import __version__
from swarm.client import StageClient
from swarm.config import ConfigError, ModelConfig, RunConfig
from swarm.identity import Member
from swarm.join import fetch_join, join_run
from swarm.model import Stage
from swarm.records import PeerRecord
from swarm.steps import host_votes, majority_step
from swarm.tokenizer import HFTokenizer, Tokenizer, load_tokenizer
from swarm.wire import WireError, decode

WEIGHTS = "model.safetensors"
METADATA = "swarm_export.json"
EXPORT_FILES = (
    WEIGHTS,
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    METADATA,
)
RETRY_S = 0.5  # pause before reading lagging stages again


class ExportError(ConfigError):
    """The swarm cannot be exported as it is now (or not to that directory); the message says why."""


@dataclass(frozen=True)
class ExportInfo:
    step: int
    out: Path
    parameters: int
    bytes: int  # size of model.safetensors
    sources: dict[int, str]  # stage -> "public name (address)" of the peer its weights came from


# -- the Hugging Face layout -------------------------------------------------------------------


def hf_name(name: str) -> str:
    """A stage parameter's name in HF's LlamaForCausalLM: everything but the head sits under `model.`."""
    return name if name.startswith("lm_head.") else f"model.{name}"


def stage_name(name: str) -> str:
    return name.removeprefix("model.")


def hf_config(cfg: ModelConfig, eos_id: int | None) -> dict:
    """config.json of HF's LlamaConfig for this model, whose tokenizer ends documents with `eos_id`.
    The rotary base is written both as the older `rope_theta` and as transformers 5's
    `rope_parameters`, so either generation reads it."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        # Only the tokenizer's own: LlamaConfig's defaults (1 and 2) would make two control bytes of
        # the byte tokenizer stop generation.
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "torch_dtype": "float32",  # the master weights; cfg.dtype is the compute precision
        "dtype": "float32",
    }


# config.json's keys -> ModelConfig's fields, and the values HF's LlamaConfig assumes when a key is absent.
HF_FIELDS = {
    "vocab_size": "vocab_size",
    "hidden_size": "d_model",
    "intermediate_size": "ffn_dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "num_key_value_heads": "n_kv_heads",
    "max_position_embeddings": "seq_len",
    "tie_word_embeddings": "tie_embeddings",
    "rope_theta": "rope_theta",
    "rms_norm_eps": "norm_eps",
}
HF_DEFAULTS = {"num_key_value_heads": None, "tie_word_embeddings": False, "rope_theta": 10000.0, "rms_norm_eps": 1e-6}


def model_config_of(hf: dict, source: str = "config.json") -> ModelConfig:
    """The ModelConfig that `hf_config` wrote; a config this model cannot express is refused."""
    if not isinstance(hf, dict):
        raise ConfigError(f"{source}: not a JSON object")
    fixed = {"model_type": "llama", "hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
    for key, expected in fixed.items():
        if hf.get(key, expected) != expected:
            raise ConfigError(f"{source}: {key} is {hf[key]!r}; swarm's model needs {expected!r}")
    missing = [key for key in HF_FIELDS if key not in hf and key not in HF_DEFAULTS]
    if missing:
        raise ConfigError(f"{source}: missing {', '.join(missing)}")
    rope = hf.get("rope_parameters") or {}
    if not isinstance(rope, dict) or rope.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
        raise ConfigError(f"{source}: rope scaling is not supported (swarm's model uses plain rotary embeddings)")
    values = {**HF_DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
    values["num_key_value_heads"] = hf.get("num_key_value_heads") or values["num_attention_heads"]
    values["rope_theta"] = rope.get("rope_theta", values["rope_theta"])
    try:
        cfg = ModelConfig.model_validate({ours: values[theirs] for theirs, ours in HF_FIELDS.items()})
    except ValidationError as err:
        hf_names = {ours: theirs for theirs, ours in HF_FIELDS.items()}
        problems = "; ".join(
            ": ".join([*(hf_names.get(str(p), str(p)) for p in e["loc"]), e["msg"].removeprefix("Value error, ")])
            for e in err.errors()
        )
        raise ConfigError(f"{source}: not a model swarm can run: {problems}") from None
    if hf.get("head_dim", cfg.head_dim) != cfg.head_dim:
        raise ConfigError(f"{source}: head_dim {hf['head_dim']} is not hidden_size / num_attention_heads")
    return cfg


def byte_characters() -> list[str]:
    """The character that stands for each byte in byte-level BPE (GPT-2's `bytes_to_unicode`, which
    the `tokenizers` ByteLevel pre-tokenizer and decoder use): printable bytes stand for themselves,
    the others for the characters from U+0100 on, in order. Written out because `tokenizers` lists
    that alphabet unordered."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    chars, shifted = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return chars


def tokenizer_files(cfg: ModelConfig, tok: Tokenizer) -> dict[str, dict | bytes]:
    """The run's tokenizer as `AutoTokenizer` reads it: its tokenizer.json as it is, or for the byte
    tokenizer `byte_tokenizer_json`; and a tokenizer_config.json naming its end-of-document token."""
    eos = tok.eos_token
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": cfg.seq_len,
        "clean_up_tokenization_spaces": False,  # would drop spaces before punctuation on decode
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": None,
        "eos_token": eos,
        "unk_token": None,
        "pad_token": None,
    }
    return {
        "tokenizer.json": tok.data if isinstance(tok, HFTokenizer) else byte_tokenizer_json(),
        "tokenizer_config.json": config,
        "special_tokens_map.json": {"eos_token": eos} if eos is not None else {},
    }


def byte_tokenizer_json() -> dict:
    """swarm.tokenizer.ByteTokenizer in the `tokenizers` format: a BPE model whose vocabulary is the
    256 byte characters and which has no merges, behind a ByteLevel pre-tokenizer without regex split
    or prefix space, so a text's ids are exactly its UTF-8 bytes; the ByteLevel decoder maps them back."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {char: b for b, char in enumerate(byte_characters())},
            "merges": [],
        },
    }


# -- reading the swarm -------------------------------------------------------------------------


class _LiveStage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    index: int
    peers: list[PeerRecord]


class _LiveSwarm(BaseModel):
    """The part of the coordinator's GET /api/v1/state that an export reads."""

    model_config = ConfigDict(extra="ignore")

    run_id: str
    stages: list[_LiveStage]


def read_live_peers(coordinator: str, run: RunConfig) -> list[list[PeerRecord]]:
    """Each stage's online peers, most optimizer steps first, from the coordinator's view of the DHT;
    peers that announce more steps than most of the stage's machines do come last (swarm/steps.py:
    any member may announce any step, to have its weights taken)."""
    url = coordinator.rstrip("/") + "/api/v1/state"
    try:
        response = httpx.get(url, timeout=10.0)
        response.raise_for_status()
        live = _LiveSwarm.model_validate(response.json())
    except (httpx.HTTPError, ValueError) as err:
        raise ExportError(f"--coordinator: cannot read the swarm from {url}: {err}") from None
    stages: list[list[PeerRecord]] = [[] for _ in range(run.stages.count)]
    for stage in live.stages:
        if 0 <= stage.index < run.stages.count:
            online = [p for p in stage.peers if p.state == "online" and p.address]
            majority = majority_step(host_votes(online))
            stages[stage.index] = sorted(
                online, key=lambda p: (p.optimizer_steps > majority, -p.optimizer_steps, p.public_name, p.peer_id)
            )
    return stages


def peer_label(peer: PeerRecord) -> str:
    return f"{peer.public_name or peer.peer_id[:12]} ({peer.address})"


@dataclass
class StageWeights:
    stage: int
    step: int
    tensors: dict[str, torch.Tensor]  # the stage's parameter names
    peer: PeerRecord


def fetch_stage(
    run: RunConfig, stage: int, peers: list[PeerRecord], timeout: float, note: Callable, member: Member
) -> StageWeights:
    """The stage's weights from the first of `peers` that hands over a complete, well-formed set."""
    with torch.device("meta"):  # shapes only: no memory, no init
        expected = {name: tuple(p.shape) for name, p in Stage(run, stage).named_parameters()}
    failures = []
    for peer in peers:
        client = StageClient(peer.address, run, timeout=timeout, member=member, peer_id=peer.peer_id)
        try:
            response = client.parameters(stage)
            tensors = _checked_tensors(response, expected)
        except grpc.RpcError as err:
            failures.append(f"{peer_label(peer)}: {err.code().name}: {err.details()}")
        except ExportError as err:
            failures.append(f"{peer_label(peer)}: {err}")
        else:
            return StageWeights(stage, response.optimizer_steps, tensors, peer)
        finally:
            client.close()
        note(f"stage {stage}: {failures[-1]}; trying another peer")
    raise ExportError(f"stage {stage}: no peer handed over its weights: " + "; ".join(failures))


def _checked_tensors(response, expected: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    got = {}
    for item in response.parameters:
        if item.tensor.dtype != "float32" or item.tensor.codec != "none":
            raise ExportError(f"{item.name}: sent as {item.tensor.dtype}/{item.tensor.codec}, not raw float32")
        try:
            got[item.name] = decode(item.tensor, item.name)
        except WireError as err:
            raise ExportError(str(err)) from None
    if set(got) != set(expected):
        missing, unknown = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        raise ExportError(f"parameters do not match the run's model (missing {missing[:3]}, unknown {unknown[:3]})")
    for name, tensor in got.items():
        if tuple(tensor.shape) != expected[name]:
            raise ExportError(f"{name}: shape {list(tensor.shape)}, the run's model has {list(expected[name])}")
        if not torch.isfinite(tensor).all():
            raise ExportError(f"{name}: holds NaN or infinite values")
    return got


def gather(run: RunConfig, coordinator: str, timeout: float, note: Callable, member: Member) -> list[StageWeights]:
    """Every stage's weights at one common optimizer step. A stage behind the others is read again
    (a step may be completing on some stages and not yet on others) until `timeout`."""
    deadline = time.monotonic() + timeout
    gathered: dict[int, StageWeights] = {}
    todo = list(range(run.stages.count))
    while True:
        live = read_live_peers(coordinator, run)
        empty = [str(k) for k in todo if not live[k]]
        if empty:
            which = f"stage {empty[0]} has" if len(empty) == 1 else f"stages {', '.join(empty)} have"
            raise ExportError(
                f"{which} no online peer, so the model cannot be gathered (wait for a peer to serve it, or start one)"
            )
        for k in todo:
            remaining = max(deadline - time.monotonic(), 10.0)
            w = gathered[k] = fetch_stage(run, k, live[k], remaining, note, member)
            params = sum(t.numel() for t in w.tensors.values())
            layers = run.stage_layers(k)
            note(
                f"stage {k}: layers {layers.start}..{layers.stop - 1}, {params:,} parameters at step {w.step} "
                f"from {peer_label(w.peer)}"
            )
        steps = {k: w.step for k, w in gathered.items()}
        newest = max(steps.values())
        todo = [k for k, s in steps.items() if s < newest]
        if not todo:
            return [gathered[k] for k in range(run.stages.count)]
        listing = ", ".join(f"stage {k}: step {s}" for k, s in steps.items())
        if time.monotonic() > deadline:
            raise ExportError(
                f"the stages are at different optimizer steps ({listing}) after {timeout:g} s; "
                "an export must not mix steps: pause or stop training and export again"
            )
        note(f"the stages are at different steps ({listing}); reading the ones behind again")
        time.sleep(RETRY_S)


# -- writing -----------------------------------------------------------------------------------


def check_out(out: Path, force: bool) -> None:
    """Refuse a destination that would lose somebody's files: a non-empty directory that holds
    anything but a previous export's files needs `force` (which replaces the export's files only)."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out: {out} exists and is not a directory")
    if out.is_dir() and not force:
        others = sorted(p.name for p in out.iterdir() if p.name not in EXPORT_FILES)
        if others:
            raise ExportError(
                f"--out: {out} is not empty and is not a previous export (it holds {', '.join(others[:5])}); "
                "choose another directory, or pass --force to write the export's files into it"
            )


def write_export(out: Path, run: RunConfig, stages: list[StageWeights], coordinator: str, force: bool) -> int:
    """Write the checkpoint into a temporary directory next to `out` and rename it into place, so
    `out` never holds half an export; returns the size of the weights file."""
    cfg = run.model
    tensors = {hf_name(name): t.contiguous() for w in stages for name, t in w.tensors.items()}
    if cfg.tie_embeddings:
        # HF ties lm_head to the embedding at load time and expects it absent from the file (the
        # stage lists the shared tensor once, under embed_tokens).
        tensors.pop("lm_head.weight", None)
    meta = {
        "format": 1,
        "run_id": run.run_id,
        "step": stages[0].step,
        "model_hash": run.model_hash(),
        "parameters": sum(t.numel() for t in tensors.values()),
        "stages": [
            {
                "stage": w.stage,
                "layers": [run.stage_layers(w.stage).start, run.stage_layers(w.stage).stop],
                "peer_id": w.peer.peer_id,
                "public_name": w.peer.public_name,
                "address": w.peer.address,
            }
            for w in stages
        ],
        "coordinator": coordinator,
        "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "swarm_version": __version__,
        "config": run.model_dump(mode="json"),
    }
    tok = load_tokenizer(run.data.tokenizer)
    documents = {
        "config.json": hf_config(cfg, tok.eos_id),
        "generation_config.json": {
            "do_sample": True,
            "temperature": 0.8,
            "top_k": 40,
            "bos_token_id": None,
            "eos_token_id": tok.eos_id,
            "pad_token_id": None,
        },
        **tokenizer_files(cfg, tok),
        METADATA: meta,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        save_file(tensors, tmp / WEIGHTS, metadata={"format": "pt"})
        for name, doc in documents.items():
            raw = doc if isinstance(doc, bytes) else (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode()
            (tmp / name).write_bytes(raw)
        size = (tmp / WEIGHTS).stat().st_size
        _move_into_place(tmp, out, force)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return size


def _move_into_place(tmp: Path, out: Path, force: bool) -> None:
    check_out(out, force)  # again: the directory may have changed while the swarm was read
    if out.is_dir() and any(p.name not in EXPORT_FILES for p in out.iterdir()):
        for name in EXPORT_FILES:  # --force into a directory with other files: replace ours, keep theirs
            os.replace(tmp / name, out / name)
        return
    if out.exists():  # empty, or a previous export: swap the whole directory
        old = out.with_name(f".{out.name}.{os.getpid()}.old")
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)


def export_swarm(
    coordinator: str,
    out: Path,
    timeout: float = 60.0,
    note: Callable[[str], None] = print,
    force: bool = False,
    join_token: str | None = None,
) -> ExportInfo:
    """Gather the run's model from its live peers into `out` (see the module docstring); `join_token`:
    the run's join token, for the coordinator, which certifies this export as a member of the run (the
    peers answer members only)."""
    out = Path(out)
    check_out(out, force)
    run, _ = fetch_join(coordinator, join_token=join_token)
    member = join_run(coordinator, RSAPrivateKey(), "trainer", run.run_id, join_token)
    note(f"exporting run {run.run_id!r}: {run.stages.count} stages, {run.model.n_layers} layers")
    stages = gather(run, coordinator, timeout, note, member)
    size = write_export(out, run, stages, coordinator, force)
    parameters = sum(t.numel() for w in stages for t in w.tensors.values())
    info = ExportInfo(
        step=stages[0].step,
        out=out,
        parameters=parameters,
        bytes=size,
        sources={w.stage: peer_label(w.peer) for w in stages},
    )
    note(
        f"exported step {info.step}: {parameters:,} parameters, {size / 2**20:.1f} MiB -> {out} "
        f"(transformers.AutoModelForCausalLM.from_pretrained or swarm generate --model {out})"
    )
    return info
