"""gRPC status codes for the server's errors, and the API key check.

Every error a client can cause already has its HTTP status in `server/errors.py`; gRPC maps that status to the
code with the same meaning (400 INVALID_ARGUMENT, 404 NOT_FOUND, 503 UNAVAILABLE: a full queue too, as Triton's
gRPC endpoint answers it, so clients' retry policies for UNAVAILABLE apply), except a cancelled request: CANCELLED
(HTTP has no such status; Triton's HTTP endpoint answers it with 400).
"""

from __future__ import annotations

import hmac

import grpc

from specserve.server.errors import http_status
from specserve.server.runner import RequestCancelledError

CODES_BY_HTTP_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
                        404: grpc.StatusCode.NOT_FOUND, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
                        499: grpc.StatusCode.CANCELLED, 501: grpc.StatusCode.UNIMPLEMENTED,
                        503: grpc.StatusCode.UNAVAILABLE}
CODES_BY_ERROR = ((RequestCancelledError, grpc.StatusCode.CANCELLED),)


def status_code(exc: BaseException) -> grpc.StatusCode:
    for error, code in CODES_BY_ERROR:
        if isinstance(exc, error):
            return code
    status = http_status(exc)
    return CODES_BY_HTTP_STATUS.get(status, grpc.StatusCode.INTERNAL if status >= 500
                                    else grpc.StatusCode.INVALID_ARGUMENT)


SERVICE = "/inference.GRPCInferenceService/"
OPEN_METHODS = {SERVICE + "ServerLive", SERVICE + "ServerReady"}  # as HTTP's health routes: no key needed
UNAUTHENTICATED_MESSAGE = "Unauthorized: a valid API key is required (authorization: Bearer <key> metadata)"


class RequireApiKey(grpc.aio.ServerInterceptor):
    """With an API key set, every RPC but ServerLive / ServerReady wants the `authorization: Bearer <key>`
    metadata (HTTP's `Authorization` header); others end UNAUTHENTICATED before their handler runs."""

    def __init__(self, api_key: str):
        self.expected = f"Bearer {api_key}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method in OPEN_METHODS:
            return handler
        given = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(given.encode() if isinstance(given, str) else given, self.expected):
            return handler
        return _refusing(handler)


async def _refuse(request_or_iterator, context) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` (unary or streaming) that ends the call UNAUTHENTICATED."""
    make = {(False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler}[handler.request_streaming, handler.response_streaming]
    return make(_refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
