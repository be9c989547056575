"""Calling a stage worker: a thin client over one gRPC channel, counting bytes both ways."""

from __future__ import annotations

import contextlib
import contextvars
import threading

import grpc
from google.protobuf.message import Message

from swarm.config import RunConfig
from swarm.identity import Member
from swarm.rpc import METHODS, method_path, pb

AUTH_METADATA_KEY = "authorization"  # gRPC metadata keys are lower case


# The deadline of the calls made in this context, when a caller sets one (`deadline`).
_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("stage_call_deadline", default=None)


@contextlib.contextmanager
def deadline(seconds: float):
    """Calls made inside get `seconds` each, instead of their client's timeout (an explicit one wins)."""
    token = _deadline.set(seconds)
    try:
        yield
    finally:
        _deadline.reset(token)


def bearer(token: str) -> str:
    return f"Bearer {token}"


def grpc_options(run: RunConfig) -> list[tuple[str, int]]:
    """Channel and server options: message limits from the run config, and HTTP/2 frames and flow
    control windows sized for multi-megabyte activations (gRPC's defaults suit small messages)."""
    limit = run.wire.max_message_mb * 2**20
    return [
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
        ("grpc.http2.max_frame_size", 2**24 - 1),
        ("grpc.http2.lookahead_bytes", 2**24),
    ]


class StageClient:
    def __init__(
        self,
        address: str,
        run: RunConfig,
        timeout: float = 120.0,
        join_token: str | None = None,
        member: Member | None = None,
        peer_id: str | None = None,
    ):
        """`member`: this process's run membership: calls go over mutual TLS with its certificate, and
        only to a server whose certificate names `peer_id` (the peer the call was routed to).
        Without one, plaintext (a static pipeline: `swarm peer --config`), where `join_token` is the
        static run's token, sent with every call (its workers refuse calls without it)."""
        self.address, self.run, self.timeout = address, run, timeout
        self._metadata = ((AUTH_METADATA_KEY, bearer(join_token)),) if join_token else None
        if member is not None:
            if not peer_id:
                raise ValueError("StageClient: a call over TLS names the peer id it expects")
            options = grpc_options(run) + member.target_options(peer_id)
            self.channel = grpc.secure_channel(address, member.channel_credentials(), options=options)
        else:
            self.channel = grpc.insecure_channel(address, options=grpc_options(run))
        self.bytes_sent = 0
        self.bytes_received = 0
        self._lock = threading.Lock()
        self._methods = {
            name: self.channel.unary_unary(
                method_path(name), request_serializer=self._serialize, response_deserializer=self._parser(response)
            )
            for name, (_, response) in METHODS.items()
        }

    def _serialize(self, message: Message) -> bytes:
        data = message.SerializeToString()
        with self._lock:
            self.bytes_sent += len(data)
        return data

    def _parser(self, response_type: type[Message]):
        def parse(data: bytes) -> Message:
            with self._lock:
                self.bytes_received += len(data)
            return response_type.FromString(data)

        return parse

    def call(self, method: str, request: Message, timeout: float | None = None) -> Message:
        timeout = timeout or _deadline.get() or self.timeout
        return self._methods[method](request, timeout=timeout, metadata=self._metadata)

    def forward(
        self,
        stage: int,
        inputs: pb.Tensor,
        microbatch_id: str,
        step: int,
        targets: pb.Tensor | None = None,
        train: bool = True,
        loss_scale: float = 0.0,
        timeout: float | None = None,
        check: bool = False,
        delayed: bool = False,
    ) -> pb.ForwardResponse:
        """`check`: a spot check's answer of a last-stage training forward (train=False); `delayed`: a
        training forward of a trainer with delayed updates (ForwardRequest.delayed)."""
        req = pb.ForwardRequest(
            run_id=self.run.run_id,
            stage=stage,
            microbatch_id=microbatch_id,
            input=inputs,
            train=train,
            step=step,
            loss_scale=loss_scale,
            check=check,
            delayed=delayed,
        )
        if targets is not None:
            req.targets.CopyFrom(targets)
        return self.call("Forward", req, timeout)

    def backward(
        self,
        stage: int,
        inputs: pb.Tensor,
        output_grad: pb.Tensor,
        microbatch_id: str,
        step: int,
        timeout: float | None = None,
        check: bool = False,
    ) -> pb.BackwardResponse:
        """`check`: a spot check's answer: the input gradient, and no gradient kept."""
        req = pb.BackwardRequest(
            run_id=self.run.run_id,
            stage=stage,
            microbatch_id=microbatch_id,
            input=inputs,
            output_grad=output_grad,
            step=step,
            check=check,
        )
        return self.call("Backward", req, timeout)

    def retract(self, stage: int, microbatch_id: str, timeout: float | None = None) -> pb.RetractResponse:
        """Take back the gradient this client's training call of `microbatch_id` added (Stage.Retract)."""
        req = pb.RetractRequest(run_id=self.run.run_id, stage=stage, microbatch_id=microbatch_id)
        return self.call("Retract", req, timeout)

    def info(self, timeout: float = 10.0) -> pb.InfoResponse:
        return self.call("Info", pb.InfoRequest(), timeout)

    def parameters(self, stage: int, with_grads: bool = False) -> pb.ParametersResponse:
        return self.call("Parameters", pb.ParametersRequest(run_id=self.run.run_id, stage=stage, with_grads=with_grads))

    def close(self) -> None:
        self.channel.close()
