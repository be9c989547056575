"""The run configuration: one typed object, loaded from a TOML file.

Every field is validated when the file is read; a bad file is refused with a `ConfigError` whose
message names the offending field, e.g. ``model.n_heads: must divide model.d_model (256)``.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

Codec = Literal["none", "fp16", "bf16", "int8"]
DType = Literal["float32", "bfloat16", "float16"]


class ConfigError(ValueError):
    """A run configuration that cannot be used; the message names the field."""


class _Strict(BaseModel):
    # Unknown keys are refused (a typo must not silently fall back to a default) and values are
    # not coerced between types ("4" is not an int).
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ModelConfig(_Strict):
    vocab_size: int = Field(256, ge=2)
    d_model: int = Field(128, ge=8)
    n_layers: int = Field(4, ge=1)
    n_heads: int = Field(4, ge=1)
    n_kv_heads: int = Field(4, ge=1)
    ffn_dim: int = Field(384, ge=1)
    seq_len: int = Field(128, ge=2)
    dtype: DType = "float32"
    tie_embeddings: bool = False
    rope_theta: float = Field(10000.0, gt=0)
    norm_eps: float = Field(1e-5, gt=0)

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
    count: int = Field(1, ge=1)
    # Number of transformer blocks each stage owns, first stage first; default an equal split
    # (earlier stages take the remainder).
    layers: list[int] | None = None


class TrainingConfig(_Strict):
    global_batch: int = Field(32, ge=1, description="sequences per optimizer step")
    micro_batch: int = Field(8, ge=1, description="sequences per forward/backward")
    steps: int = Field(1000, ge=1, description="horizon of the learning-rate schedule")
    lr: float = Field(3e-3, gt=0)
    min_lr: float = Field(3e-4, ge=0)
    warmup_steps: int = Field(20, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    grad_clip: float = Field(1.0, ge=0, description="max global grad norm; 0 disables")
    seed: int = Field(0, ge=0)
    eval_every: int = Field(50, ge=0, description="steps between validation passes; 0 disables")
    eval_batches: int = Field(4, ge=1)

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


class DataConfig(_Strict):
    source: Literal["embedded", "files", "huggingface"] = "embedded"
    path: str | None = Field(None, description="file or folder, for source = 'files'")
    dataset: str | None = Field(None, description="datasets.load_dataset name, for 'huggingface'")
    dataset_config: str | None = None
    data_files: list[str] | None = None
    split: str = "train"
    text_field: str = "text"
    val_fraction: float = Field(0.05, gt=0, lt=0.5)

    @model_validator(mode="after")
    def _source(self) -> DataConfig:
        if self.source == "files" and not self.path:
            raise ValueError("path: required when source = 'files'")
        if self.source == "huggingface" and not self.dataset:
            raise ValueError("dataset: required when source = 'huggingface'")
        return self


class RebalanceConfig(_Strict):
    """When peers move between stages (swarm/rebalance.py)."""

    period_s: float = Field(30.0, gt=0, description="mean seconds between checks (randomised 0.5x to 1.5x)")
    margin: float = Field(0.1, ge=0.1, description="a move must lift the stage totals by more than this fraction")


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

    @model_validator(mode="after")
    def _timeouts(self) -> AveragingConfig:
        if self.request_timeout_s >= self.matchmaking_time_s:
            raise ValueError(
                f"request_timeout_s: {self.request_timeout_s} must be below matchmaking_time_s "
                f"({self.matchmaking_time_s})"
            )
        return self


class RunConfig(_Strict):
    run_id: str = Field("swarm", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    model: ModelConfig = ModelConfig()
    stages: StagesConfig = StagesConfig()
    training: TrainingConfig = TrainingConfig()
    wire: WireConfig = WireConfig()
    serve: ServeConfig = ServeConfig()
    rebalance: RebalanceConfig = RebalanceConfig()
    averaging: AveragingConfig = AveragingConfig()
    data: DataConfig = DataConfig()

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

    def model_hash(self) -> str:
        """A short fingerprint of everything that decides the weights' shapes and layout."""
        blob = self.model.model_dump_json() + self.stages.model_dump_json()
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


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
    return parse_config(data, str(path))
