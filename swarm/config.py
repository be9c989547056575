"""The run configuration: one typed object, loaded from a TOML file.

Every field is validated when the file is read; a bad file is refused with a `ConfigError` whose
message names the offending field, e.g. ``model.n_heads: must divide model.d_model (256)``.
"""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from pathlib import Path
from typing import Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

Codec = Literal["none", "fp16", "bf16", "int8"]
DType = Literal["float32", "bfloat16", "float16"]
GradCompression = Literal["none", "fp16", "int8", "int4", "powersgd"]
AveragingMode = Literal["gradients", "diloco"]


class ConfigError(ValueError):
    """A run configuration that cannot be used; the message names the field."""


class _Strict(BaseModel):
    # Unknown keys are refused (a typo must not silently fall back to a default) and values are
    # not coerced between types ("4" is not an int).
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ModelConfig(_Strict):
    vocab_size: int = Field(256, ge=2, description="tokens (default: data.tokenizer's; 256 for bytes)")
    d_model: int = Field(128, ge=8, description="hidden size")
    n_layers: int = Field(4, ge=1, description="transformer blocks, cut into stages")
    n_heads: int = Field(4, ge=1, description="attention heads (must divide d_model)")
    n_kv_heads: int = Field(4, ge=1, description="key/value heads, grouped-query attention (divides n_heads)")
    ffn_dim: int = Field(384, ge=1, description="SwiGLU inner size")
    seq_len: int = Field(128, ge=2, description="tokens per training sequence (and the longest context)")
    dtype: DType = Field("float32", description="weights and activations")
    tie_embeddings: bool = Field(False, description="share the embedding with the LM head (one stage only)")
    rope_theta: float = Field(10000.0, gt=0, description="rotary embedding base")
    norm_eps: float = Field(1e-5, gt=0, description="RMSNorm epsilon")
    checkpoint_activations: bool = Field(
        False,
        description="recompute each block in backward instead of keeping its activations: a stage keeps only its "
        "blocks' inputs per microbatch in flight, for about a third more compute",
    )

    @model_validator(mode="after")
    def _heads(self) -> ModelConfig:
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads: {self.n_heads} must divide d_model ({self.d_model})")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("n_heads: head size d_model / n_heads must be even for rotary embeddings")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads: {self.n_kv_heads} must divide n_heads ({self.n_heads})")
        return self

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class StagesConfig(_Strict):
    count: int = Field(1, ge=1, description="pipeline stages")
    # Earlier stages take the remainder of an equal split.
    layers: list[int] | None = Field(None, description="blocks per stage, first stage first (default: equal split)")


class TrainingConfig(_Strict):
    global_batch: int = Field(32, ge=1, description="sequences per optimizer step")
    micro_batch: int = Field(8, ge=1, description="sequences per forward/backward")
    steps: int = Field(1000, ge=1, description="horizon of the learning-rate schedule")
    lr: float = Field(3e-3, gt=0, description="peak learning rate (AdamW), after linear warmup")
    min_lr: float = Field(3e-4, ge=0, description="the cosine decay ends here, at `steps`")
    warmup_steps: int = Field(20, ge=0, description="steps of linear warmup")
    weight_decay: float = Field(0.1, ge=0, description="AdamW decoupled weight decay (not on norms)")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW beta2")
    grad_clip: float = Field(1.0, ge=0, description="max global grad norm; 0 disables")
    seed: int = Field(0, ge=0, description="weights init and data order")
    eval_every: int = Field(50, ge=0, description="steps between validation passes; 0 disables")
    eval_batches: int = Field(4, ge=1, description="micro-batches of the held-out split per validation pass")

    @model_validator(mode="after")
    def _batches(self) -> TrainingConfig:
        if self.global_batch % self.micro_batch:
            raise ValueError(
                f"global_batch: {self.global_batch} must be a multiple of micro_batch ({self.micro_batch})"
            )
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr: {self.min_lr} must not exceed lr ({self.lr})")
        return self

    @property
    def accumulation(self) -> int:
        return self.global_batch // self.micro_batch


class WireConfig(_Strict):
    codec: Codec = Field("none", description="activations and gradients on the wire")
    max_message_mb: int = Field(256, ge=1, le=2047, description="gRPC message size limit, both directions")


class ServeConfig(_Strict):
    """How a stage worker serves requests."""

    max_batch: int = Field(64, ge=1, description="largest batch (sequences) one request may carry")
    max_batch_tokens: int = Field(16384, ge=1, description="concurrent requests are batched up to this")
    cache_size: int = Field(64, ge=0, description="forward activations kept for the matching backward")
    request_timeout_s: float = Field(120.0, gt=0, description="longest a request waits in the queue")


REMOTE_DATA = ("hf://", "https://", "http://")  # where a dataset file may live without being a local path


def _path_like(name: str) -> bool:
    """A dataset name that datasets.load_dataset would take for a local folder or file."""
    return name.startswith(("/", ".", "~")) or Path(name).expanduser().exists()


class DataConfig(_Strict):
    source: Literal["embedded", "files", "huggingface"] = Field(
        "embedded", description="the training text; embedded is CPython's documentation, shipped with Python"
    )
    path: str | None = Field(
        None, description="file or folder, for source = 'files': text, .jsonl and .parquet files, read by suffix"
    )
    dataset: str | None = Field(None, description="datasets.load_dataset name, for 'huggingface' (streamed)")
    dataset_config: str | None = Field(None, description="its configuration name")
    data_files: list[str] | None = Field(None, description="its data_files")
    split: str = Field("train", description="its split")
    text_field: str = Field("text", min_length=1, description="the field of text in .jsonl, .parquet and datasets")
    val_fraction: float = Field(
        0.05, gt=0, lt=0.5, description="the fraction of documents held out for validation (by a stable hash)"
    )
    tokenizer: str = Field(
        "bytes",
        min_length=1,
        description="'bytes' (UTF-8 bytes, vocab 256) or a tokenizer.json (swarm tokenizer train), relative to "
        "the config file; model.vocab_size follows it",
    )

    def local_paths(self) -> list[str]:
        """The paths on the reading machine this section would make a trainer read: the path of
        `files`, and a `huggingface` dataset or data file that is not remote (datasets reads a local
        folder or file as readily as a hub dataset)."""
        if self.source == "files":
            return [self.path or ""]
        if self.source != "huggingface":
            return []
        paths = [self.dataset] if self.dataset and _path_like(self.dataset) else []
        return paths + [f for f in self.data_files or [] if not f.startswith(REMOTE_DATA)]

    @model_validator(mode="after")
    def _source(self) -> DataConfig:
        if self.source == "files" and not self.path:
            raise ValueError("path: required when source = 'files'")
        if self.source == "huggingface" and not self.dataset:
            raise ValueError("dataset: required when source = 'huggingface'")
        return self


class RebalanceConfig(_Strict):
    """When peers move between stages (swarm/rebalance.py)."""

    period_s: float = Field(10.0, gt=0, description="mean seconds between checks (randomised 0.5x to 1.5x)")
    margin: float = Field(
        0.1,
        ge=0.01,
        le=1,
        description="a move must lift the stage totals by more than this fraction (with many peers per stage, "
        "by half a peer's share of a stage when that is less)",
    )


class AveragingConfig(_Strict):
    """How the peers of a stage average their gradients (hivemind.Optimizer, peer/averaging.py).

    On one machine or a LAN, 0.5 to 1 s of matchmaking is plenty; over the internet use 5 to 15 s,
    with `averaging_timeout_s` 30 to 60 s and `chunk_timeout_s` 10 to 30 s. Every global step
    costs about one matchmaking time plus the all-reduce.
    """

    matchmaking_time_s: float = Field(1.0, gt=0, description="how long peers gather into a group each step")
    request_timeout_s: float = Field(0.5, gt=0, description="wait for a group leader's answer (< matchmaking)")
    averaging_timeout_s: float = Field(
        10.0, gt=0, description="longest a step waits for its all-reduce (a failed round costs this much)"
    )
    chunk_timeout_s: float = Field(
        5.0, gt=0, description="a peer whose next part of the all-reduce is this late is left out of it"
    )
    load_state_timeout_s: float = Field(60.0, gt=0, description="longest a joiner waits for a stage's state")
    sync_timeout_s: float = Field(
        5.0, gt=0, description="after the trainer moved on, wait this long for the stage's sample count"
    )
    contribution_clip: float = Field(
        10.0, ge=0, description="clip each peer's gradient to this many x training.grad_clip before averaging; 0: off"
    )
    compression: GradCompression = Field(
        "none",
        description="what the all-reduce sends: none (4 bytes a value), fp16 (2), int8 (1, blocks of 256 with a "
        "scale), int4 (0.52, the same blocks; for diloco's pseudo-gradients), powersgd (each weight matrix as two "
        "rank-`rank` factors, 4 bytes a value, with error feedback)",
    )
    rank: int = Field(
        4, ge=1, le=256, description="powersgd: the rank of the approximation (bytes per m x n matrix: 4 (m + n) rank)"
    )
    mode: AveragingMode = Field(
        "gradients",
        description="gradients: average every step's gradient; diloco: inner_steps local AdamW steps per replica, "
        "then average the replicas' pseudo-gradients and take an outer Nesterov step",
    )
    # H = 5: within 2% of the reference's held-out loss on tiny.toml and small.toml, where H = 10 was
    # 5% above it; with int4 it averages the bytes of int8 at H = 10 (docs/performance.md, Averaging).
    inner_steps: int = Field(
        5, ge=1, le=100_000, description="diloco: local steps between two averagings (H): H-fold fewer bytes averaged"
    )
    # At H = 10 the outer step that trained best was the plain average of the replicas' weights
    # (outer_lr 1, no momentum): see docs/performance.md (Averaging) and benchmarks/results.md.
    outer_lr: float = Field(1.0, gt=0, le=10, description="diloco: the outer step's learning rate")
    outer_momentum: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="diloco: the outer step's Nesterov momentum (0: none; DiLoCo's 0.9 with outer_lr 0.7 suits H "
        "in the hundreds)",
    )
    paths: Literal["routed", "pinned"] = Field(
        "routed",
        description="diloco: routed: each stage's replica is picked for each microbatch by the router; pinned: a "
        "microbatch goes on to the replica of the next stage that its replica of the previous stage fed before, so "
        "that each replica trains beside the same replicas of the other stages within an inner phase",
    )

    @model_validator(mode="after")
    def _timeouts(self) -> AveragingConfig:
        if self.request_timeout_s >= self.matchmaking_time_s:
            raise ValueError(
                f"request_timeout_s: {self.request_timeout_s} must be below matchmaking_time_s "
                f"({self.matchmaking_time_s})"
            )
        return self


class VerifyConfig(_Strict):
    """Spot checks: the trainer re-sends some forward calls to a second peer of the stage and
    compares the answers (swarm/verify.py)."""

    fraction: float = Field(
        0.02, ge=0, le=1, description="share of training forward calls also sent to a second peer; 0 disables checks"
    )
    first_checks: int = Field(
        2,
        ge=0,
        description="until each peer passed this many checks (after joining, after a strike), all calls are checked",
    )
    strikes: int = Field(
        2, ge=1, description="times a peer is outvoted (its answer against two that agree) before the trainer bans it"
    )
    rtol: float | None = Field(
        None, gt=0, description="relative tolerance, norm(a - b) / norm(a) (default: from model.dtype and wire.codec)"
    )
    ban_s: float = Field(
        300.0,
        ge=0,
        description="a banned peer gets calls again after this long, each checked until it passes first_checks; "
        "0: banned for the rest of the run",
    )


RUN_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")


class RunConfig(_Strict):
    run_id: str = Field(
        "swarm",
        min_length=1,
        max_length=64,
        description="names the run in the DHT and the peers' checkpoint folders: letters, digits and ._- only, "
        "not starting with '.'",
    )
    model: ModelConfig = ModelConfig()
    stages: StagesConfig = StagesConfig()
    training: TrainingConfig = TrainingConfig()
    wire: WireConfig = WireConfig()
    serve: ServeConfig = ServeConfig()
    rebalance: RebalanceConfig = RebalanceConfig()
    averaging: AveragingConfig = AveragingConfig()
    verify: VerifyConfig = VerifyConfig()
    data: DataConfig = DataConfig()

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, value: str) -> str:
        # A peer makes {checkpoint_dir}/{run_id}/: '..' or a '/' would put it outside.
        if not RUN_ID.fullmatch(value):
            raise ValueError(f"{value!r}: use letters, digits and . _ - only, not starting with '.'")
        return value

    @model_validator(mode="after")
    def _stages(self) -> RunConfig:
        n, s = self.model.n_layers, self.stages.count
        if s > n:
            raise ValueError(f"stages.count: {s} stages but only {n} layers (model.n_layers)")
        layers = self.stages.layers
        if layers is not None:
            if len(layers) != s:
                raise ValueError(f"stages.layers: {len(layers)} entries for stages.count = {s}")
            if any(k < 1 for k in layers):
                raise ValueError("stages.layers: every stage needs at least one layer")
            if sum(layers) != n:
                raise ValueError(f"stages.layers: sums to {sum(layers)}, model.n_layers is {n}")
        if self.serve.max_batch < self.training.micro_batch:
            raise ValueError(
                f"serve.max_batch: {self.serve.max_batch} is below training.micro_batch ({self.training.micro_batch})"
            )
        if self.model.tie_embeddings and s > 1:
            raise ValueError(
                "model.tie_embeddings: needs stages.count = 1 (the embedding and the LM head live on different stages)"
            )
        return self

    def stage_layers(self, stage: int) -> range:
        """The global indices of the transformer blocks that `stage` owns."""
        if not 0 <= stage < self.stages.count:
            raise ValueError(f"stage {stage} out of range: the run has {self.stages.count} stages")
        n, s = self.model.n_layers, self.stages.count
        sizes = self.stages.layers or [n // s + (1 if k < n % s else 0) for k in range(s)]
        start = sum(sizes[:stage])
        return range(start, start + sizes[stage])

    def with_stages(self, count: int, layers: list[int] | None = None) -> RunConfig:
        """The same run cut into `count` stages (validated like a file)."""
        data = self.model_dump()
        data["stages"] = {"count": count, "layers": layers}
        return RunConfig.model_validate(data)

    def with_data(self, path: str) -> RunConfig:
        """The same run trained on the text files at `path` (a file, or a folder of them)."""
        data = self.model_dump()
        data["data"] = {
            "source": "files",
            "path": path,
            "val_fraction": self.data.val_fraction,
            "tokenizer": self.data.tokenizer,
        }
        return RunConfig.model_validate(data)

    def model_hash(self) -> str:
        """A short fingerprint of everything that decides the weights' shapes and layout."""
        # Recomputing activations changes neither the weights nor the results: peers that differ in it agree.
        blob = self.model.model_dump_json(exclude={"checkpoint_activations"}) + self.stages.model_dump_json()
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def dump_config(run: RunConfig) -> str:
    """The run as a TOML file that load_config reads back to an equal RunConfig (unset options, which
    are None, are left out). Written here because the standard library reads TOML but cannot write it,
    and the config is flat enough (scalars and lists, one level of tables) not to need a package."""
    data = run.model_dump()
    top = [f"{k} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, dict) and v is not None]
    tables = [
        "\n".join([f"[{k}]"] + [f"{name} = {_toml_value(v)}" for name, v in table.items() if v is not None])
        for k, table in data.items()
        if isinstance(table, dict)
    ]
    return "\n\n".join(["\n".join(top), *tables]) + "\n"


def config_reference() -> str:
    """Every option of a run config as Markdown tables, one per section (the reference in docs/configuration.md)."""
    out = []
    for section, field in RunConfig.model_fields.items():
        model = field.annotation
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            out.append(f"`{section}` (default `{field.default}`): {field.description}\n")
            continue
        out.append(f"`[{section}]`\n\n| option | default | meaning |\n|---|---|---|")
        for name, f in model.model_fields.items():
            default = "none" if f.default is None else _toml_value(f.default)
            meaning = f.description or ""
            if get_origin(f.annotation) is Literal:
                meaning += " (" + ", ".join(map(str, get_args(f.annotation))) + ")"
            out.append(f"| `{name}` | `{default}` | {meaning} |")
        out.append("")
    return "\n".join(out)


def _field_path(loc: tuple) -> str:
    return ".".join(str(part) for part in loc)


def format_validation_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        where = _field_path(e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        # Section-level validators report against the section and start their message with the
        # field's name: join the two so the full dotted path comes first.
        if where and re.match(r"^[a-z_]+: ", msg):
            where, msg = f"{where}.{msg.split(': ', 1)[0]}", msg.split(": ", 1)[1]
        lines.append(f"{source}: {where + ': ' if where else ''}{msg}")
    return "\n".join(lines)


def parse_config(data: dict, source: str = "config") -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source)) from None


def load_config(path: str | Path) -> RunConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read config: {err.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None
    return resolve_tokenizer(parse_config(data, str(path)), path.parent, str(path))


def resolve_tokenizer(run: RunConfig, config_dir: Path, source: str = "config") -> RunConfig:
    """The run with its tokenizer read: `data.tokenizer` made an absolute path (a relative one is
    relative to `config_dir`), and `model.vocab_size` the tokenizer's when the config leaves it
    out; a config that sets another vocab_size is refused. A file the tokenizers package cannot
    read is refused here, before anything starts."""
    from swarm.tokenizer import BYTES, load_tokenizer  # it imports this module

    spec = run.data.tokenizer
    if spec != BYTES:
        spec = str((config_dir / Path(spec).expanduser()).resolve())
    try:
        tok = load_tokenizer(spec)
    except ConfigError as err:
        raise ConfigError(f"{source}: data.tokenizer: {err}") from None
    if "vocab_size" in run.model.model_fields_set and run.model.vocab_size != tok.vocab_size:
        raise ConfigError(
            f"{source}: model.vocab_size: {run.model.vocab_size}, but the tokenizer ({spec}) has {tok.vocab_size} "
            "tokens; set it to that, or leave it out to take the tokenizer's"
        )
    data = run.model_dump()
    data["data"]["tokenizer"] = spec
    data["model"]["vocab_size"] = tok.vocab_size
    return parse_config(data, source)
