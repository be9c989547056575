"""Checking a stage request before any work is done on it.

Every field is checked against the run config and the stage this worker serves: run id, stage
index, dtype, shape, size limits, finite values, decodable payload. A bad request raises
`RequestError` with the gRPC status code and a message that names what was wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import torch

from swarm.config import RunConfig
from swarm.records import MAX_STEP  # the highest global step a request may name
from swarm.rpc import pb
from swarm.wire import FLOAT_DTYPES, WireError, all_finite, check, decode

if TYPE_CHECKING:
    from peer.graphs import WeightsAt

MAX_ID_LENGTH = 128


class RequestError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass
class StageShape:
    """What a stage accepts and returns, derived from the run config."""

    run: RunConfig
    stage: int

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.run.stages.count - 1

    @property
    def output_width(self) -> int:
        return self.run.model.vocab_size if self.is_last else self.run.model.d_model


def check_target(run: RunConfig, stage: int, run_id: str, requested: int) -> None:
    if not run_id:  # an empty (or all-default) request is malformed, not meant for another run
        raise invalid("run_id: missing")
    if run_id != run.run_id:
        raise RequestError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"run_id: request is for run {run_id!r}, this worker serves {run.run_id!r}",
        )
    if requested >= run.stages.count:
        raise invalid(f"stage: unknown stage {requested}, run {run.run_id!r} has {run.stages.count} stages")
    if requested != stage:
        raise RequestError(
            grpc.StatusCode.FAILED_PRECONDITION, f"stage: this worker serves stage {stage}, not stage {requested}"
        )


def _batch_and_length(shape: tuple[int, ...], run: RunConfig, field: str) -> tuple[int, int]:
    b, t = shape[0], shape[1]
    if not 1 <= b <= run.serve.max_batch:
        raise invalid(f"{field}: batch size {b} outside 1..{run.serve.max_batch} (serve.max_batch)")
    if not 1 <= t <= run.model.seq_len:
        raise invalid(f"{field}: sequence length {t} outside 1..{run.model.seq_len} (model.seq_len)")
    return b, t


def _decode(msg: pb.Tensor, field: str) -> torch.Tensor:
    try:
        return decode(msg, field)
    except WireError as err:
        raise invalid(str(err)) from None


def decode_token_ids(msg: pb.Tensor, run: RunConfig, field: str, like: tuple[int, int] | None = None) -> torch.Tensor:
    if msg.dtype not in ("int64", "int32"):
        raise invalid(f"{field}: dtype {msg.dtype or '(empty)'} where token ids (int64 or int32) are expected")
    if len(msg.shape) != 2:
        raise invalid(f"{field}: shape {list(msg.shape)} where [batch, seq_len] is expected")
    shape = _batch_and_length(tuple(msg.shape), run, field)
    if like is not None and shape != like:
        raise invalid(f"{field}: shape {list(shape)} does not match the input's {list(like)}")
    ids = _decode(msg, field).long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= run.model.vocab_size):
        raise invalid(f"{field}: token ids must lie in 0..{run.model.vocab_size - 1}")
    return ids


def check_hidden(msg: pb.Tensor, run: RunConfig, field: str, width: int, like: tuple | None = None) -> tuple:
    """Check a hidden-state (or gradient) message's header and payload size; its shape."""
    if msg.dtype not in FLOAT_DTYPES:
        raise invalid(f"{field}: dtype {msg.dtype or '(empty)'} where a floating tensor is expected")
    if len(msg.shape) != 3 or msg.shape[2] != width:
        raise invalid(f"{field}: shape {list(msg.shape)} where [batch, seq_len, {width}] is expected")
    shape = tuple(msg.shape)
    _batch_and_length(shape, run, field)
    if like is not None and shape[:2] != tuple(like[:2]):
        raise invalid(f"{field}: shape {list(shape)} does not match the input's {list(like)}")
    try:
        check(msg, field)
    except WireError as err:
        raise invalid(str(err)) from None
    return shape


def decode_hidden(msg: pb.Tensor, run: RunConfig, field: str, width: int, like: tuple | None = None) -> torch.Tensor:
    check_hidden(msg, run, field, width, like)
    x = _decode(msg, field)
    if not all_finite(x):
        raise invalid(f"{field}: contains NaN or Inf")
    return x


def decode_stage_input(msg: pb.Tensor, shape: StageShape, field: str = "input") -> torch.Tensor:
    if not msg.ByteSize():
        raise invalid(f"{field}: missing")
    if shape.is_first:
        return decode_token_ids(msg, shape.run, field)
    return decode_hidden(msg, shape.run, field, shape.run.model.d_model)


def check_microbatch_id(mb_id: str) -> None:
    if len(mb_id) > MAX_ID_LENGTH:
        raise invalid(f"microbatch_id: longer than {MAX_ID_LENGTH} characters")


def check_step(step: int) -> None:
    if step > MAX_STEP:
        raise invalid(f"step: {step} is beyond the last step a run can have ({MAX_STEP})")


@dataclass
class ForwardWork:
    inputs: torch.Tensor
    targets: torch.Tensor | None
    train: bool
    loss_scale: float
    microbatch_id: str
    step: int
    check: bool = False  # last stage, not train: loss and input gradient, no gradient kept (a spot check)
    caller: str = ""  # who sent it (`caller_of`): the only one who may retract its gradient
    delayed: bool = False  # a delayed-updates trainer's: its backward may run on the weights before a step

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.inputs.shape)


@dataclass
class CachedForward:
    """A training forward's input and output, graph attached, kept for the matching backward."""

    inputs: torch.Tensor
    output: torch.Tensor
    version: int  # the worker's weights version when it was recorded (RecordedGraphs.version)
    weights: WeightsAt | None = None  # the weights the graph saw: a delayed forward's outlive a step
    delayed: bool = False  # the forward's caller trains with delayed updates (ForwardRequest.delayed)


@dataclass
class BackwardWork:
    inputs: torch.Tensor | None  # None when `cached` holds the forward: the input is not needed
    output_grad: torch.Tensor
    microbatch_id: str
    step: int
    input_shape: tuple[int, ...]
    cached: CachedForward | None = None
    check: bool = False  # the input gradient only, no gradient kept (a spot check)
    caller: str = ""  # who sent it (`caller_of`): the only one who may retract its gradient


def parse_forward(req: pb.ForwardRequest, shape: StageShape) -> ForwardWork:
    check_target(shape.run, shape.stage, req.run_id, req.stage)
    check_microbatch_id(req.microbatch_id)
    check_step(req.step)
    x = decode_stage_input(req.input, shape)
    targets = None
    if req.HasField("targets"):
        if not shape.is_last:
            raise invalid(f"targets: only the last stage ({shape.run.stages.count - 1}) takes targets")
        targets = decode_token_ids(req.targets, shape.run, "targets", like=tuple(x.shape[:2]))
    if req.train and targets is None and shape.is_last:
        raise invalid("targets: required for a training forward on the last stage")
    if req.check and (req.train or targets is None):
        raise invalid("check: only for a last-stage forward with targets and train=false")
    if req.delayed and (not req.train or shape.is_last):
        raise invalid(f"delayed: only for a training forward of a stage before the last ({shape.run.stages.count - 1})")
    scale = req.loss_scale
    if (req.train or req.check) and shape.is_last:
        if scale == 0.0:
            scale = x.shape[0] / shape.run.training.global_batch
        if not (0.0 < scale <= 1.0):
            raise invalid(f"loss_scale: {scale} outside (0, 1]")
    return ForwardWork(x, targets, req.train, scale, req.microbatch_id, req.step, check=req.check, delayed=req.delayed)


def parse_backward(
    req: pb.BackwardRequest, shape: StageShape, claim_cached: Callable[[str], CachedForward | None] | None = None
) -> BackwardWork:
    """Check a Backward request. When `claim_cached` hands over this microbatch's recorded forward,
    the input's header is still checked but its payload is not decoded: it will not be used."""
    check_target(shape.run, shape.stage, req.run_id, req.stage)
    check_microbatch_id(req.microbatch_id)
    check_step(req.step)
    cached = claim_cached(req.microbatch_id) if claim_cached and req.microbatch_id else None
    x = None
    if cached is not None and not shape.is_first:  # token ids (stage 0) are cheap: always decoded
        if not req.input.ByteSize():
            raise invalid("input: missing")
        in_shape = check_hidden(req.input, shape.run, "input", shape.run.model.d_model)
        if in_shape != tuple(cached.inputs.shape):
            cached = None
    if cached is None or shape.is_first:
        x = decode_stage_input(req.input, shape)
        in_shape = tuple(x.shape)
    if not req.output_grad.ByteSize():
        raise invalid("output_grad: missing")
    grad = decode_hidden(req.output_grad, shape.run, "output_grad", shape.output_width, like=in_shape)
    if cached is not None and tuple(cached.output.shape) != tuple(grad.shape):
        cached = None
        x = x if x is not None else decode_stage_input(req.input, shape)
    return BackwardWork(x, grad, req.microbatch_id, req.step, in_shape, cached, check=req.check)
