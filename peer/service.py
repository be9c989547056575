"""The stage service: a gRPC server in front of a `StageWorker`.

Request bytes are parsed here rather than by grpc-python's generated servicer: that one answers
bytes that do not parse with INTERNAL ("Exception deserializing request!"), which reads as a server
bug. Here they get INVALID_ARGUMENT with the parser's message, like every other bad request.
INTERNAL is left for real faults of this server.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent import futures

import grpc
from google.protobuf.message import DecodeError, Message

from peer.auth import JoinTokenCheck
from peer.requests import (
    RequestError,
    StageShape,
    check_microbatch_id,
    check_target,
    invalid,
    parse_backward,
    parse_forward,
)
from peer.worker import StageWorker
from swarm import __version__
from swarm.client import grpc_options
from swarm.identity import Member
from swarm.rpc import METHODS, SERVICE, pb
from swarm.wire import encode

log = logging.getLogger(__name__)

# A caller whose deadline is nearer than this is taken as gone: the answer would reach it too late,
# it retries elsewhere, and a gradient kept here would count its microbatch twice.
ANSWER_MARGIN_S = 0.25


def caller_waiting(context: grpc.ServicerContext) -> bool:
    """Whether the caller of a request still waits. The deadline is looked at as well as
    `is_active()`: a process that was stopped (SIGSTOP, a machine asleep) runs on after it resumes
    before gRPC notices that the deadline passed meanwhile."""
    remaining = context.time_remaining()
    return context.is_active() and (remaining is None or remaining > ANSWER_MARGIN_S)


def caller_of(context: grpc.ServicerContext) -> str:
    """Who sent a request: the name in its TLS certificate (a run with a coordinator), else its host."""
    names = context.auth_context().get("x509_common_name")
    if names:
        return "cn:" + names[0].decode(errors="replace")
    return context.peer().rsplit(":", 1)[0]  # "ipv4:127.0.0.1:52044": the port changes with the channel


class StageService:
    def __init__(self, worker: StageWorker, member: Member | None = None):
        """`member`: this peer's run membership, which refuses revoked callers (TLS checked the rest)."""
        self.worker, self.member = worker, member
        self.run = worker.run
        self.shape = StageShape(worker.run, worker.stage_index)
        self.codec = worker.run.wire.codec
        self.bytes_sent = 0
        self.bytes_received = 0
        self._count_lock = threading.Lock()

    # -- plumbing ----------------------------------------------------------------------------

    def _count(self, received: int = 0, sent: int = 0) -> None:
        with self._count_lock:
            self.bytes_received += received
            self.bytes_sent += sent

    def _serialize(self, message: Message) -> bytes:
        data = message.SerializeToString()
        self._count(sent=len(data))
        return data

    def _handler(self, request_type: type[Message], method: Callable) -> grpc.RpcMethodHandler:
        def handle(data: bytes, context: grpc.ServicerContext):
            self._count(received=len(data))
            if self.member is not None and (refused := self.member.refusal(context)):
                context.abort(grpc.StatusCode.PERMISSION_DENIED, refused)
            request = request_type()
            try:
                try:
                    request.ParseFromString(data)
                except DecodeError as err:
                    raise invalid(f"request is not a valid {request_type.DESCRIPTOR.full_name}: {err}") from None
                return method(request, context)
            except RequestError as err:
                context.abort(err.code, err.message)

        return grpc.unary_unary_rpc_method_handler(
            handle, request_deserializer=None, response_serializer=self._serialize
        )

    def generic_handler(self) -> grpc.GenericRpcHandler:
        # Each method of the service is served by the method of the same name in lower case.
        handlers = {name: self._handler(request, getattr(self, name.lower())) for name, (request, _) in METHODS.items()}
        return grpc.method_handlers_generic_handler(SERVICE, handlers)

    def _wait(self, future: futures.Future, context: grpc.ServicerContext):
        remaining = context.time_remaining()
        timeout = (
            self.run.serve.request_timeout_s if remaining is None else min(remaining, self.run.serve.request_timeout_s)
        )
        try:
            return future.result(timeout=timeout)
        except futures.TimeoutError:
            if not future.cancel():
                # The worker is committing this request's gradient (peer/queue.py `Task.claim`): the
                # answer is moments away, and a caller told DEADLINE_EXCEEDED would retry it elsewhere.
                return future.result(timeout=self.run.serve.request_timeout_s)
            raise RequestError(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"request waited {timeout:.0f} s in the queue"
            ) from None

    def _stage_step(self, future: futures.Future) -> int:
        """The step the stage reached with this request (peer/stepper.py `stage_step`), as this peer says."""
        return self.worker.faults.claimed_steps(future.stage_step)

    # -- the RPCs ----------------------------------------------------------------------------

    def forward(self, request: pb.ForwardRequest, context) -> pb.ForwardResponse:
        work = parse_forward(request, self.shape)
        work.caller = caller_of(context)
        future = self.worker.submit(work, lambda: caller_waiting(context))
        result = self._wait(future, context)
        response = pb.ForwardResponse(
            loss=result.loss, queue_s=getattr(future, "queue_s", 0.0), stage_step=self._stage_step(future)
        )
        answer = self.worker.faults.answer
        if result.output is not None:
            response.output.CopyFrom(encode(answer(result.output), self.codec))
        if result.input_grad is not None:
            response.input_grad.CopyFrom(
                encode(self.worker.faults.answer_grad(result.input_grad, work.check), self.codec)
            )
        return response

    def backward(self, request: pb.BackwardRequest, context) -> pb.BackwardResponse:
        work = parse_backward(request, self.shape, self.worker.claim_cached)
        work.caller = caller_of(context)
        future = self.worker.submit(work, lambda: caller_waiting(context))
        grad = self._wait(future, context)
        response = pb.BackwardResponse(queue_s=getattr(future, "queue_s", 0.0), stage_step=self._stage_step(future))
        if grad is not None:
            response.input_grad.CopyFrom(encode(self.worker.faults.answer_grad(grad, work.check), self.codec))
        return response

    def retract(self, request: pb.RetractRequest, context) -> pb.RetractResponse:
        check_target(self.run, self.worker.stage_index, request.run_id, request.stage)
        check_microbatch_id(request.microbatch_id)
        return pb.RetractResponse(samples=self.worker.retract(request.microbatch_id, caller_of(context)))

    def info(self, request: pb.InfoRequest, context) -> pb.InfoResponse:
        w = self.worker
        return pb.InfoResponse(
            run_id=self.run.run_id,
            stage=w.stage_index,
            num_stages=self.run.stages.count,
            model_hash=self.run.model_hash(),
            codec=self.codec,
            version=__version__,
            queue_length=len(w.queue),
            throughput=w.throughput,
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            samples_served=w.samples_served,
            optimizer_steps=w.optimizer_steps,
            device=w.device_name,
        )

    def parameters(self, request: pb.ParametersRequest, context) -> pb.ParametersResponse:
        check_target(self.run, self.worker.stage_index, request.run_id, request.stage)
        # The step must be the one the weights include (an export refuses to mix steps): a step
        # taken while the snapshot waited for the worker's lock shows as a changed count, and the
        # snapshot is taken again.
        for _ in range(3):
            steps = self.worker.weights_step
            params, grads = self.worker.named_tensors(request.with_grads)
            if self.worker.weights_step == steps:
                break
        else:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "the stage kept stepping while its weights were read")
        # Always raw float32 (codec "none"), whatever the run's wire codec: weights are copied, not trained through.
        return pb.ParametersResponse(
            parameters=[pb.NamedTensor(name=n, tensor=encode(t, "none")) for n, t in params.items()],
            grads=[pb.NamedTensor(name=n, tensor=encode(t, "none")) for n, t in grads.items()],
            optimizer_steps=steps,
        )


class StageServer:
    """A started gRPC server with the thread pool its calls run on, stopped together.

    grpc-python never shuts down the pool a server was given: its threads lived on after `stop`
    until the garbage collector happened to free the server, so a peer that moved between stages
    kept up to `max_threads` idle threads per stage it had served."""

    # How long `stop` waits for calls to end beyond their grace period (cancelled ones end at once).
    STOP_MARGIN_S = 2.0

    def __init__(self, server: grpc.Server, pool: futures.ThreadPoolExecutor):
        self.server, self.pool = server, pool

    def stop(self, grace: float | None = None) -> None:
        """Refuse new calls, give those in progress `grace` seconds (None: none) before they are
        cancelled, then end the pool's threads (each after the call it is running)."""
        self.server.stop(grace).wait((grace or 0) + self.STOP_MARGIN_S)
        self.pool.shutdown(wait=False, cancel_futures=True)


def start_server(
    worker: StageWorker,
    host: str,
    port: int,
    max_threads: int = 32,
    join_token: str | None = None,
    member: Member | None = None,
) -> tuple[StageServer, StageService, int]:
    """Start serving; returns the server, the service and the bound port (useful with port 0). With
    `member` (a run with a coordinator), over mutual TLS: callers present a certificate of the run's
    CA, and revoked ones are refused. Without, plaintext (a static pipeline), where `join_token`
    is asked of every call (peer/auth.py)."""
    service = StageService(worker, member)
    pool = futures.ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix=f"stage-{worker.stage_index}-call")
    server = grpc.server(
        pool,
        options=grpc_options(worker.run),
        interceptors=[JoinTokenCheck(join_token)] if join_token else None,
    )
    server.add_generic_rpc_handlers((service.generic_handler(),))
    address = f"{host}:{port}"
    if member is not None:
        bound = server.add_secure_port(address, member.server_credentials())
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    server.start()
    return StageServer(server, pool), service, bound
