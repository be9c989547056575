"""The join token at a stage worker: every RPC must carry `authorization: Bearer TOKEN` metadata.

A gRPC server interceptor checks the metadata before any handler runs, so a call without the run's
join token is refused with UNAUTHENTICATED whatever the method (Forward, Backward, Info,
Parameters), and the refusal never says what the token is.
"""

from __future__ import annotations

import hmac

import grpc

from swarm.client import AUTH_METADATA_KEY, bearer


class JoinTokenCheck(grpc.ServerInterceptor):
    def __init__(self, token: str):
        self._expected = bearer(token).encode()

        def refuse(request: bytes, context: grpc.ServicerContext) -> None:
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong join token: this run's stage workers need the join token its operator "
                "gave out (swarm train --join-token, or $SWARM_JOIN_TOKEN)",
            )

        self._refuse = grpc.unary_unary_rpc_method_handler(refuse)

    def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        metadata = handler_call_details.invocation_metadata or ()
        given = next((v for k, v in metadata if k == AUTH_METADATA_KEY), "")
        if isinstance(given, str) and hmac.compare_digest(given.encode(), self._expected):
            return continuation(handler_call_details)
        return self._refuse
