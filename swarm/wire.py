"""Tensors on the wire: encode to and decode from the `Tensor` message, with a codec.

Codecs: "none" (raw bytes), "fp16" and "bf16" (16-bit floats), "int8" (blockwise absmax 8-bit,
one float32 scale per 256 values: 0.254 x the bytes of float32). The averaging all-reduce also has
4-bit blocks (`_int4_encode`), too coarse for activations: it is not a wire codec.

They are written here in torch rather than taken from `hivemind.compression`, for three reasons
measured on this data plane: hivemind's codecs serialize into their own protobuf message
(`runtime_pb2.Tensor`), which costs two extra copies of every payload in each direction (a 2 MB
activation took 3-12 ms per round instead of under 1 ms); its bf16 path sends float32 unless the
USE_LEGACY_BFLOAT16 environment variable is cleared; and its 8-bit codecs (Uniform8Bit,
Quantile8Bit) fail to decode under numpy >= 2.4 while BlockwiseQuantization needs bitsandbytes.

`decode` checks the message against its declared dtype, shape and codec before touching the bytes,
and raises `WireError` naming what was wrong, so a malformed request is refused, never crashes.
"""

from __future__ import annotations

import math
import warnings

import torch

from swarm.rpc import pb

CODECS = ("none", "fp16", "bf16", "int8")
INT8_BLOCK = 256
INT4_LEVELS = 7  # codes -7 .. 7, stored as 1 .. 15 in a nibble
MAX_ELEMENTS = 2**31 - 1

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
}
FLOAT_DTYPES = {"float32", "float16", "bfloat16"}
FP16_MAX = torch.finfo(torch.float16).max


class WireError(ValueError):
    """A tensor message that cannot be decoded; the message says why."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def encoded_nbytes(dtype: str, shape: tuple[int, ...], codec: str) -> int:
    numel = math.prod(shape)
    if codec == "none":
        return numel * DTYPES[dtype].itemsize
    if codec in ("fp16", "bf16"):
        return numel * 2
    return numel + 4 * math.ceil(numel / INT8_BLOCK)


def encode(tensor: torch.Tensor, codec: str = "none") -> pb.Tensor:
    """Encode a tensor; lossy codecs apply to floating tensors only (ids always travel raw)."""
    if codec not in CODECS:
        raise WireError(f"unknown codec {codec!r}: expected one of {', '.join(CODECS)}")
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    name = dtype_name(tensor.dtype)
    if not tensor.is_floating_point():
        codec = "none"
    tensor = tensor.contiguous()
    if codec == "int8":
        data = _int8_encode(tensor)
    elif codec == "fp16":
        data = _raw_bytes(tensor.float().clamp(-FP16_MAX, FP16_MAX).to(torch.float16))
    elif codec == "bf16":
        data = _raw_bytes(tensor.to(torch.bfloat16))
    else:
        data = _raw_bytes(tensor)
    return pb.Tensor(dtype=name, shape=list(tensor.shape), codec=codec, data=data)


def check(msg: pb.Tensor, what: str = "tensor") -> tuple[torch.dtype, tuple[int, ...]]:
    """Validate a message's header against its payload without decoding it."""
    if msg.codec not in CODECS:
        raise WireError(f"{what}: unknown codec {msg.codec!r} (expected one of {', '.join(CODECS)})")
    if msg.dtype not in DTYPES:
        raise WireError(f"{what}: unsupported dtype {msg.dtype!r} (expected one of {', '.join(DTYPES)})")
    if msg.codec != "none" and msg.dtype not in FLOAT_DTYPES:
        raise WireError(f"{what}: codec {msg.codec} applies to floating tensors, not {msg.dtype}")
    shape = tuple(msg.shape)
    if any(d < 0 for d in shape):
        raise WireError(f"{what}: negative dimension in shape {list(shape)}")
    if math.prod(shape) > MAX_ELEMENTS:
        raise WireError(f"{what}: shape {list(shape)} has too many elements")
    expected = encoded_nbytes(msg.dtype, shape, msg.codec)
    if len(msg.data) != expected:
        raise WireError(
            f"{what}: payload has {len(msg.data)} bytes, expected {expected} for "
            f"{msg.dtype}{list(shape)} with codec {msg.codec}"
        )
    return DTYPES[msg.dtype], shape


def all_finite(x: torch.Tensor) -> bool:
    # NaN and +-Inf always show up in the minimum or maximum; one pass, no boolean temporary
    # (about 10x cheaper than torch.isfinite(x).all() on a 2 MB activation).
    if not x.numel():
        return True
    return bool(torch.isfinite(torch.stack(torch.aminmax(x))).all())


def expect(msg: pb.Tensor, what: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Decode a floating tensor that must have exactly `shape` and finite values (a peer's answer,
    checked before it is used); `WireError` naming what was wrong otherwise."""
    if msg.dtype not in FLOAT_DTYPES:
        raise WireError(f"{what}: dtype {msg.dtype or '(empty)'} where a floating tensor is expected")
    if tuple(msg.shape) != shape:
        raise WireError(f"{what}: shape {list(msg.shape)} where {list(shape)} is expected")
    x = decode(msg, what)
    if not all_finite(x):
        raise WireError(f"{what}: contains NaN or Inf")
    return x


def decode(msg: pb.Tensor, what: str = "tensor") -> torch.Tensor:
    dtype, shape = check(msg, what)
    data = msg.data
    if msg.codec == "int8":
        return _int8_decode(data, shape).to(dtype)
    if msg.codec in ("fp16", "bf16"):
        return _from_bytes(data, torch.float16 if msg.codec == "fp16" else torch.bfloat16, shape).to(dtype)
    return _from_bytes(data, dtype, shape).clone()


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    # numpy has no bfloat16: reinterpret its bits as int16 to get at the bytes.
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.numpy().tobytes()


def _from_bytes(
    data: bytes, dtype: torch.dtype, shape: tuple[int, ...], offset: int = 0, count: int = -1
) -> torch.Tensor:
    """A read-only view of `data` as a tensor (callers copy or convert before anything writes)."""
    if len(data) == offset or count == 0:
        return torch.empty(shape if count < 0 else (0,), dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "The given buffer is not writable"
        flat = torch.frombuffer(data, dtype=dtype, offset=offset, count=count)
    return flat.reshape(shape) if count < 0 else flat


def _blocks(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(float32 values in rows of INT8_BLOCK, zero-padded; each row's largest magnitude, numel, rows)."""
    flat = tensor.reshape(-1).float()
    numel, n_blocks = flat.numel(), math.ceil(flat.numel() / INT8_BLOCK)
    if numel % INT8_BLOCK:
        flat = torch.nn.functional.pad(flat, (0, n_blocks * INT8_BLOCK - numel))
    blocks = flat.view(n_blocks, INT8_BLOCK)
    return blocks, blocks.abs().amax(dim=1).clamp_min_(1e-30), numel, n_blocks


def _int8_encode(tensor: torch.Tensor) -> bytes:
    blocks, absmax, numel, n_blocks = _blocks(tensor)
    # One buffer holds the float32 scales and then the codes, so the payload is copied out once.
    out = torch.empty(4 * n_blocks + n_blocks * INT8_BLOCK, dtype=torch.uint8)
    out[: 4 * n_blocks].view(torch.float32).copy_(absmax / 127.0)
    codes = out[4 * n_blocks :].view(torch.int8).view(n_blocks, INT8_BLOCK)
    codes.copy_(blocks.mul(127.0 / absmax[:, None]).round_().clamp_(-127, 127))
    return out[: 4 * n_blocks + numel].numpy().tobytes()


def _int8_decode(data: bytes, shape: tuple[int, ...]) -> torch.Tensor:
    numel = math.prod(shape)
    n_blocks = math.ceil(numel / INT8_BLOCK)
    scales = _from_bytes(data, torch.float32, (n_blocks,), count=n_blocks)
    codes = _from_bytes(data, torch.int8, (numel,), offset=4 * n_blocks, count=numel)
    if numel % INT8_BLOCK:
        codes = torch.nn.functional.pad(codes.float(), (0, n_blocks * INT8_BLOCK - numel))
    out = codes.view(n_blocks, INT8_BLOCK).float().mul_(scales[:, None])
    return out.reshape(-1)[:numel].reshape(shape)


def _int4_encode(tensor: torch.Tensor) -> bytes:
    """Blocks of INT8_BLOCK values, a float32 scale (absmax / 7) per block, then two 4-bit codes a
    byte (the even value in the low nibble): 0.516 bytes a value."""
    blocks, absmax, numel, _ = _blocks(tensor)
    codes = blocks.mul(INT4_LEVELS / absmax[:, None]).round_().clamp_(-INT4_LEVELS, INT4_LEVELS)
    codes = codes.add_(INT4_LEVELS + 1).to(torch.uint8).view(-1, 2)
    packed = codes[:, 0] | (codes[:, 1] << 4)
    scales = (absmax / INT4_LEVELS).view(torch.uint8)
    return torch.cat((scales, packed[: math.ceil(numel / 2)])).numpy().tobytes()


def _int4_decode(data: bytes, shape: tuple[int, ...]) -> torch.Tensor:
    numel = math.prod(shape)
    n_blocks = math.ceil(numel / INT8_BLOCK)
    scales = _from_bytes(data, torch.float32, (n_blocks,), count=n_blocks)
    packed = _from_bytes(data, torch.uint8, (numel,), offset=4 * n_blocks, count=math.ceil(numel / 2))
    codes = torch.stack((packed & 15, packed >> 4), dim=1).view(-1).float().sub_(INT4_LEVELS + 1)
    codes = torch.nn.functional.pad(codes, (0, n_blocks * INT8_BLOCK - codes.numel()))
    out = codes.view(n_blocks, INT8_BLOCK).mul_(scales[:, None])
    return out.reshape(-1)[:numel].reshape(shape)
