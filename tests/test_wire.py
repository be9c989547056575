"""Wire codecs: round trips within each codec's precision, sizes, and refusal of bad headers."""

import pytest
import torch

from swarm.wire import WireError, decode, encode

ERROR = {"none": 0.0, "fp16": 1e-3, "bf16": 8e-3, "int8": 8e-3}  # max error relative to the absmax


@pytest.mark.parametrize("codec", ["none", "fp16", "bf16", "int8"])
@pytest.mark.parametrize("shape", [(8, 64, 128), (3, 5, 7), (1, 1), (0, 4)])
def test_round_trip_within_codec_precision(codec, shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3
    msg = encode(x, codec)
    y = decode(msg)
    assert y.shape == x.shape and y.dtype == x.dtype
    if x.numel():
        assert (y - x).abs().max().item() <= ERROR[codec] * x.abs().max().item() + 1e-12


def test_payload_sizes_relative_to_float32():
    x = torch.randn(8, 256, 256)
    raw = len(encode(x, "none").data)
    assert raw == x.numel() * 4
    assert len(encode(x, "fp16").data) == len(encode(x, "bf16").data) == raw // 2
    assert len(encode(x, "int8").data) <= 0.26 * raw


def test_token_ids_always_travel_raw_and_exact():
    ids = torch.randint(0, 256, (4, 32))
    for codec in ("none", "fp16", "int8"):
        msg = encode(ids, codec)
        assert msg.codec == "none" and torch.equal(decode(msg), ids)


def test_bfloat16_tensors_round_trip_exactly():
    x = torch.randn(4, 16).bfloat16()
    assert torch.equal(decode(encode(x, "none")), x)


def test_fp16_saturates_instead_of_overflowing():
    x = torch.tensor([1e6, -1e6, 1.0])
    y = decode(encode(x, "fp16"))
    assert torch.isfinite(y).all() and y[0] == torch.finfo(torch.float16).max


@pytest.mark.parametrize(
    "edit, phrase",
    [
        (lambda m: setattr(m, "codec", "zip"), "unknown codec"),
        (lambda m: setattr(m, "dtype", "complex64"), "unsupported dtype"),
        (lambda m: setattr(m, "data", m.data[:-1]), "payload has"),
        (lambda m: m.shape.__setitem__(0, -2), "negative dimension"),
    ],
)
def test_bad_headers_are_refused(edit, phrase):
    msg = encode(torch.randn(2, 3), "none")
    edit(msg)
    with pytest.raises(WireError, match=phrase):
        decode(msg)
