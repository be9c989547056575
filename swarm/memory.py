"""How much memory a stage needs on a device, and how much the device has.

A stage worker holds, on its device: the stage's float32 weights (autocast keeps master weights in
float32), two float32 gradient buffers (the accumulated gradient and the fresh buffers a batch fills
before it is committed: peer/pending.py `StagedGrads`), AdamW's two float32 states, and the
activations its in-flight microbatches keep for their backward. The activations are counted tensor
by tensor from what this model's blocks save for backward (swarm/model.py), in the autocast dtype
where autocast applies (CUDA with a 16-bit `model.dtype`), else float32; the residual stream and
the RMSNorms stay float32 either way. With `model.checkpoint_activations`, a microbatch keeps only
each block's input, and one block's activations are rebuilt at a time in backward.

A peer's in-flight microbatches are the forward graphs it keeps for their backward (its forward
cache: `serve.cache_size`, or `swarm peer --inflight`) plus the one batch being computed.

Not counted: the averaging buffers hivemind keeps in host memory when peers of a stage average
(`peer/averaging.py`), and the CUDA context (about 0.5 GiB, outside `max_memory_allocated`): the
overhead covers them and the allocator's slack.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from swarm.config import ConfigError, RunConfig

FP32 = 4
_HALF = {"bfloat16": 2, "float16": 2}
OVERHEAD_FRACTION = 0.1  # the allocator's slack and short-lived temporaries, of the tensors' total
OVERHEAD_FIXED = {"cuda": 768 * 2**20, "cpu": 512 * 2**20}  # the CUDA context / the interpreter and torch


def stage_parameters(run: RunConfig, stage: int) -> int:
    """Parameters of stage `stage`, counted from the config (building a 1b stage to count would take
    seconds and gigabytes)."""
    m = run.model
    kv = m.n_kv_heads * m.head_dim
    block = 2 * m.d_model + 2 * m.d_model * m.d_model + 2 * m.d_model * kv + 3 * m.d_model * m.ffn_dim
    count = len(run.stage_layers(stage)) * block
    if stage == 0:
        count += m.vocab_size * m.d_model
    if stage == run.stages.count - 1:
        count += m.d_model + (0 if m.tie_embeddings else m.vocab_size * m.d_model)
    return count


def autocasts(run: RunConfig, device_type: str) -> bool:
    """Whether the worker computes in a 16-bit dtype here (as swarm.device.autocast decides)."""
    return device_type == "cuda" and run.model.dtype in _HALF


def block_bytes_per_token(run: RunConfig, device_type: str) -> int:
    """What one transformer block saves for backward, per token."""
    m = run.model
    d, kv, f = m.d_model, m.n_kv_heads * m.head_dim, m.ffn_dim
    half = autocasts(run, device_type)
    a = _HALF[m.dtype] if half else FP32
    norms = 2 * (2 * d + 1) * FP32  # each RMSNorm: its float32 input and normalised input, and the rsqrt
    # Linear inputs: autocast casts a normed input once per projection that reads it (q, k, v; gate,
    # up); in float32 the projections share it.
    linear_inputs = (3 + 2 if half else 1 + 1) * d * a
    # q, k, v and the output, which o_proj reads as it is (attention returns it token-major); the log-sum-exp
    attention = (2 * d + 2 * kv) * a + m.n_heads * FP32
    swiglu = 4 * f * a  # gate, silu(gate), up, and their product
    return norms + linear_inputs + attention + swiglu


def ends_bytes_per_token(run: RunConfig, stage: int, device_type: str) -> int:
    """What the embedding (first stage), the head (last stage) and the cached output keep, per token."""
    m = run.model
    a = _HALF[m.dtype] if autocasts(run, device_type) else FP32
    out = 8 if stage == 0 else 0  # the token ids
    if stage == run.stages.count - 1:
        # norm, head input, log-softmax, targets
        out += (2 * m.d_model + 1) * FP32 + m.d_model * a + m.vocab_size * FP32 + 8
    else:
        out += m.d_model * FP32  # the output, kept with the graph for the backward that brings its gradient
    return out


def microbatch_bytes(run: RunConfig, stage: int, device_type: str) -> int:
    """What one training microbatch in flight keeps on the device until its backward."""
    tokens = run.training.micro_batch * run.model.seq_len
    blocks = len(run.stage_layers(stage))
    if run.model.checkpoint_activations:
        per_block = run.model.d_model * FP32  # the block's input, from which backward recomputes the rest
    else:
        per_block = block_bytes_per_token(run, device_type)
    return tokens * (blocks * per_block + ends_bytes_per_token(run, stage, device_type))


def recompute_bytes(run: RunConfig, device_type: str) -> int:
    """With checkpointed activations: the one block whose activations backward rebuilds at a time."""
    if not run.model.checkpoint_activations:
        return 0
    return run.training.micro_batch * run.model.seq_len * block_bytes_per_token(run, device_type)


def peer_inflight(run: RunConfig, cached: int | None = None) -> int:
    """The microbatches a peer may hold at once: the forward graphs it keeps (`cached`, default
    `serve.cache_size`) and the batch it computes."""
    return (run.serve.cache_size if cached is None else cached) + 1


@dataclass(frozen=True)
class StageMemory:
    """Bytes a stage needs on one device, by what holds them."""

    stage: int
    device_type: str
    inflight: int
    parameters: int
    weights: int
    grads: int
    optimizer: int
    activations: int
    overhead: int

    @property
    def tensors(self) -> int:
        """What torch allocates: everything but the overhead."""
        return self.weights + self.grads + self.optimizer + self.activations

    @property
    def total(self) -> int:
        return self.tensors + self.overhead

    def describe(self) -> str:
        rows = [
            ("weights (float32)", self.weights),
            ("gradients (2 x float32)", self.grads),
            ("optimizer (AdamW, 2 x float32)", self.optimizer),
            (f"activations ({self.inflight} microbatches)", self.activations),
            ("overhead", self.overhead),
            ("total", self.total),
        ]
        head = f"stage {self.stage} on {self.device_type}: {self.parameters / 1e6:.1f}M parameters"
        return "\n".join([head] + [f"  {name:<34} {human(n):>10}" for name, n in rows])


def human(n: int) -> str:
    """Bytes as MiB, or GiB from 1 GiB up."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def estimate(run: RunConfig, stage: int, device_type: str, inflight: int) -> StageMemory:
    """What stage `stage` of `run` needs on a `device_type` ('cpu' or 'cuda') device with `inflight`
    training microbatches held at once."""
    if inflight < 1:
        raise ValueError(f"inflight: {inflight} must be at least 1")
    n = stage_parameters(run, stage)
    activations = inflight * microbatch_bytes(run, stage, device_type) + recompute_bytes(run, device_type)
    weights, grads, optimizer = n * FP32, 2 * n * FP32, 2 * n * FP32
    overhead = OVERHEAD_FIXED[device_type] + int(OVERHEAD_FRACTION * (weights + grads + optimizer + activations))
    return StageMemory(stage, device_type, inflight, n, weights, grads, optimizer, activations, overhead)


def available(device: torch.device) -> int:
    """Bytes this process could still take on `device`: free CUDA memory, or the host's MemAvailable."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line")


class StageTooLarge(ConfigError):
    """A stage this device cannot hold; the message says what to change."""


def budget(device: torch.device, max_memory: int | None = None) -> int:
    """The bytes a stage may take here: what the device has available, capped at `max_memory`."""
    free = available(device)
    return free if max_memory is None else min(free, max_memory)


def refusal(need: StageMemory, limit: int, run: RunConfig) -> str | None:
    """Why `need` does not fit in `limit` bytes, with what to change; None when it fits."""
    if need.total <= limit:
        return None
    remedies = [f"fewer in flight (swarm peer --inflight N, now {need.inflight - 1})"]
    if not run.model.checkpoint_activations:
        remedies.append("[model] checkpoint_activations = true")
    remedies.append("another stage")
    return (
        f"stage {need.stage} needs {human(need.total)} on {need.device_type} ({need.inflight} microbatches in "
        f"flight), {human(limit)} available: use {', or '.join(remedies)}"
    )


def check_stage(run: RunConfig, stage: int, device_type: str, inflight: int, limit: int) -> StageMemory:
    """The estimate for `stage`; raises StageTooLarge when it needs more than `limit` bytes."""
    need = estimate(run, stage, device_type, inflight)
    if (why := refusal(need, limit, run)) is not None:
        raise StageTooLarge(why)
    return need


def fitting_stages(run: RunConfig, device_type: str, inflight: int, limit: int) -> list[int]:
    """The stages of `run` that fit in `limit` bytes."""
    return [k for k in range(run.stages.count) if refusal(estimate(run, k, device_type, inflight), limit, run) is None]


def fits_beside(
    run: RunConfig, held: int, stage: int, device_type: str, inflight: int, free: int, max_memory: int | None
) -> bool:
    """Whether stage `stage` can be loaded while stage `held` is still in memory (a peer that moves keeps
    serving its stage until the next one is loaded: peer/daemon.py `PeerDaemon.move`): it fits in the
    `free` bytes the device has now, and both together within `max_memory` (None: no cap)."""
    need = estimate(run, stage, device_type, inflight).total
    both = need + estimate(run, held, device_type, inflight).total
    return need <= free and (max_memory is None or both <= max_memory)


def dry_run(run: RunConfig, device: torch.device, inflight: int, limit: int) -> tuple[str, bool]:
    """Every stage's estimate, each marked as fitting in `limit` bytes or not; and whether any fits."""
    lines = [f"run {run.run_id!r}: {human(limit)} available on {device}, {inflight} microbatches in flight per stage"]
    fits = False
    for k in range(run.stages.count):
        need = estimate(run, k, device.type, inflight)
        why = refusal(need, limit, run)
        fits |= why is None
        lines += [need.describe(), f"  -> {'fits' if why is None else 'does not fit: ' + why}"]
    return "\n".join(lines), fits
