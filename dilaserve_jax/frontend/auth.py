"""Bearer-token authentication for the gRPC server (health checks and reflection stay open)."""
from __future__ import annotations

import hmac

import grpc

OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str):
        if not token:
            raise ValueError("auth token must not be empty")
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIXES):
            return handler
        supplied = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(supplied.encode(), self._expected):
            return handler
        message = "missing bearer token" if not supplied else "wrong bearer token"
        return _deny(handler, message)


def _deny(handler, message: str):
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    if handler.stream_stream:
        return grpc.stream_stream_rpc_method_handler(streaming, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)
