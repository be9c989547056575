"""A Llama-style decoder, cut into pipeline stages.

RMSNorm, rotary position embeddings, grouped-query causal attention through
`scaled_dot_product_attention`, SwiGLU MLP. Parameter names follow the Hugging Face Llama layout
(`embed_tokens`, `layers.{i}.self_attn.q_proj`, ..., `norm`, `lm_head`) so a stage's state dict
maps onto an exported checkpoint one to one.

A `Stage` is blocks i..j of the model: stage 0 also owns the token embedding, the last stage also
owns the final norm and the LM head. With one stage, the `Stage` is the whole model.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from swarm.config import ModelConfig, RunConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary_tables(cfg: ModelConfig, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [seq_len, head_dim], in the half-rotation layout of HF Llama."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
    angles = torch.outer(torch.arange(cfg.seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(device), angles.sin().to(device)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos[:t], sin[:t]), apply_rotary(k, cos[:t], sin[:t])
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = CausalSelfAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Stage(nn.Module):
    """Blocks `layers` of the model, plus the embedding on the first stage and the head on the last.

    Input: token ids [B, T] (first stage) or hidden states [B, T, d_model].
    Output: hidden states [B, T, d_model], or logits [B, T, vocab] on the last stage.
    """

    def __init__(self, run: RunConfig, index: int):
        super().__init__()
        cfg = run.model
        self.cfg, self.index = cfg, index
        self.layer_ids = run.stage_layers(index)
        self.is_first, self.is_last = index == 0, index == run.stages.count - 1
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model) if self.is_first else None
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in self.layer_ids})
        if self.is_last:
            self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
            if cfg.tie_embeddings:
                self.lm_head.weight = self.embed_tokens.weight
        cos, sin = rotary_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        init_weights(self, run.training.seed, cfg.n_layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = self.embed_tokens(x)
        # Only a forward that records a graph gains from recomputing: evaluation keeps nothing anyway.
        recompute = self.cfg.checkpoint_activations and self.training and torch.is_grad_enabled()
        for block in self.layers.values():
            if recompute:
                # Non-reentrant: the backward may run much later (the stage worker caches the graph), and
                # the recompute runs under the autocast of the forward. The blocks draw no random numbers.
                x = checkpoint(block, x, self.rope_cos, self.rope_sin, use_reentrant=False, preserve_rng_state=False)
            else:
                x = block(x, self.rope_cos, self.rope_sin)
        if self.is_last:
            x = self.lm_head(self.norm(x))
        return x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in float32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def init_weights(stage: Stage, seed: int, n_layers: int) -> None:
    """Deterministic init: each parameter draws from its own generator, seeded by the run seed and
    the parameter's global name, so a stage's weights do not depend on how the model is split nor
    on which process builds it (CPU generators are bitwise reproducible)."""
    for name, param in stage.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        std = 0.02
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            std /= math.sqrt(2 * n_layers)  # residual projections, as in GPT-2
        param.copy_(torch.normal(0.0, std, param.shape, generator=gen))


def build_stages(run: RunConfig) -> list[Stage]:
    return [Stage(run, k) for k in range(run.stages.count)]
