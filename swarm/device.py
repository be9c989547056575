"""Which torch device to run on, and in which precision."""

from __future__ import annotations

import contextlib
import re

import torch

from swarm.config import ConfigError, DType

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str | None = None) -> torch.device:
    """`None`/'auto': CUDA when available, else CPU. Otherwise 'cpu', 'cuda' or 'cuda:N'."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if not re.fullmatch(r"cuda(:\d+)?", name):
        raise ConfigError(f"--device: {name!r} is not one of auto, cpu, cuda, cuda:N")
    if not torch.cuda.is_available():
        raise ConfigError(f"--device: {name} requested but CUDA is not available on this machine")
    device = torch.device(name)
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"--device: {name} but only {torch.cuda.device_count()} CUDA device(s)")
    return device


def autocast(device: torch.device, dtype: DType) -> contextlib.AbstractContextManager:
    """Mixed precision on CUDA in the config's dtype; master weights stay float32.

    On CPU everything runs in float32: CPU autocast to bf16 is slower than float32 on most CPUs.
    """
    if device.type == "cuda" and dtype != "float32":
        return torch.autocast("cuda", dtype=_DTYPES[dtype])
    return contextlib.nullcontext()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"
