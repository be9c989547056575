"""`swarm generate`: sample text from an export, with swarm's own model (no transformers needed).

An export's config.json maps back onto a `ModelConfig` and its weights load into a one-stage
`Stage` (the whole model); its tokenizer.json is the run's tokenizer. Sampling is plain
autoregression: temperature, top-k, the context cut to the last `seq_len` tokens, a stop at the
tokenizer's end-of-document token.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from swarm.config import ConfigError, DataConfig, RunConfig, resolve_tokenizer
from swarm.export import WEIGHTS, hf_name, model_config_of
from swarm.model import Stage
from swarm.tokenizer import Tokenizer

TOKENIZER = "tokenizer.json"


def load_export(path: str | Path) -> tuple[Stage, RunConfig]:
    """The exported model as one `Stage` in eval mode, and a one-stage run config holding its
    ModelConfig and, as `data.tokenizer`, its tokenizer.json (whose vocabulary must be the model's).
    A directory that is not a loadable export raises ConfigError naming the problem."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"--model: {path} is not a directory (expected the output of swarm export)")
    config_path, weights_path = path / "config.json", path / WEIGHTS
    for required in (config_path, weights_path, path / TOKENIZER):
        if not required.is_file():
            raise ConfigError(f"--model: {path} has no {required.name}; is it a swarm export?")
    try:
        hf = json.loads(config_path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{config_path}: not readable JSON: {err}") from None
    cfg = model_config_of(hf, str(config_path))
    run = resolve_tokenizer(
        RunConfig(run_id="export", model=cfg, data=DataConfig(tokenizer=TOKENIZER)), path, f"--model {path}"
    )
    try:
        tensors = load_file(weights_path)
    except (OSError, SafetensorError) as err:
        raise ConfigError(f"{weights_path}: not a readable safetensors file: {err}") from None
    model = Stage(run, 0)
    expected = {hf_name(name): p for name, p in model.named_parameters()}
    unknown = sorted(set(tensors) - set(expected))
    missing = sorted(set(expected) - set(tensors))
    if unknown or missing:
        raise ConfigError(
            f"{weights_path}: tensors do not match config.json's model"
            + (f"; missing {', '.join(missing[:5])}" if missing else "")
            + (f"; unknown {', '.join(unknown[:5])}" if unknown else "")
        )
    with torch.no_grad():
        for name, param in expected.items():
            if tensors[name].shape != param.shape:
                raise ConfigError(
                    f"{weights_path}: {name} has shape {list(tensors[name].shape)}, "
                    f"config.json's model needs {list(param.shape)}"
                )
            param.copy_(tensors[name])
    return model.eval(), run


@torch.no_grad()
def sample(
    model: Stage,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = 40,
    seed: int | None = 0,
) -> tuple[str, int]:
    """The continuation of `prompt` and how many tokens it took: up to `max_new_tokens` tokens drawn
    one at a time, until the tokenizer's end-of-document token (not part of the text), decoded
    (invalid UTF-8 becomes U+FFFD). Temperature 0 takes the most likely token; `seed` None draws
    from a fresh generator. Each step runs the whole window again: no KV cache, since the models
    small enough for a CPU recompute a window of a few hundred tokens in milliseconds."""
    if not prompt:
        raise ConfigError("--prompt: must not be empty")
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens: {max_new_tokens} must be at least 1")
    if temperature < 0:
        raise ConfigError(f"--temperature: {temperature} must not be negative")
    if top_k is not None and top_k < 1:
        raise ConfigError(f"--top-k: {top_k} must be at least 1")
    device = next(model.parameters()).device
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    tokens = tokenizer.encode(prompt).to(device)
    new: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(tokens[-model.cfg.seq_len :][None])[0, -1].float()
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            if top_k is not None and top_k < logits.numel():
                cutoff = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < cutoff, float("-inf"))
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = int(torch.multinomial(probs, 1, generator=gen))
        if nxt == tokenizer.eos_id:
            return tokenizer.decode(new), len(new) + 1
        new.append(nxt)
        tokens = torch.cat([tokens, torch.tensor([nxt], device=device)])
    return tokenizer.decode(new), len(new)
