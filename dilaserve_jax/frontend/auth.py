"""Who may call what: bearer tokens for inference, a separate admin token for the calls that read
the server's disk or reshape it, and the rule for admin calls on a reachable address.

- Health checking and reflection are always open.
- Inference calls need `authorization: Bearer <auth token>` when an auth token is set (the admin
  token is accepted too).
- Admin calls (`ReloadWeights`, `Reconfigure`, `SetControllerMode`) need the admin token when one is set. Without one
  they are allowed only on a loopback address (under the auth token, if set); on any other
  address they are refused with PERMISSION_DENIED.
"""
from __future__ import annotations

import hmac
import ipaddress

import grpc

OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
ADMIN_METHODS = frozenset({"/dilaserve.v1.DiLaServe/ReloadWeights", "/dilaserve.v1.DiLaServe/Reconfigure",
                           "/dilaserve.v1.DiLaServe/SetControllerMode"})


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class AccessInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, auth_token: str | None, admin_token: str | None, host: str):
        if auth_token == "" or admin_token == "":
            raise ValueError("tokens must not be empty")
        self._auth = f"Bearer {auth_token}".encode() if auth_token else None
        self._admin = f"Bearer {admin_token}".encode() if admin_token else None
        self._host = host
        self.admin_open = admin_token is None and is_loopback(host)

    @property
    def active(self) -> bool:
        return bool(self._auth or self._admin or not self.admin_open)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIXES):
            return handler
        supplied = dict(details.invocation_metadata or ()).get("authorization", "").encode()
        if details.method in ADMIN_METHODS:
            return self._admin_check(handler, supplied)
        if self._auth is None or _same(supplied, self._auth) or (self._admin and _same(supplied, self._admin)):
            return handler
        return _deny(handler, grpc.StatusCode.UNAUTHENTICATED, "missing bearer token" if not supplied
                     else "wrong bearer token")

    def _admin_check(self, handler, supplied: bytes):
        if self._admin is not None:
            if _same(supplied, self._admin):
                return handler
            if not supplied:
                return _deny(handler, grpc.StatusCode.UNAUTHENTICATED, "admin call: missing admin bearer token")
            return _deny(handler, grpc.StatusCode.PERMISSION_DENIED, "admin call: this token may not administer "
                                                                     "the server (use the admin token)")
        if not self.admin_open:
            return _deny(handler, grpc.StatusCode.PERMISSION_DENIED,
                         f"admin calls are disabled: the server listens on {self._host} (not loopback) without "
                         "--admin-token")
        if self._auth is None or _same(supplied, self._auth):
            return handler
        return _deny(handler, grpc.StatusCode.UNAUTHENTICATED, "missing bearer token" if not supplied
                     else "wrong bearer token")


def _same(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)


def _deny(handler, code: grpc.StatusCode, message: str):
    async def unary(request, context):
        await context.abort(code, message)

    async def streaming(request, context):
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    if handler.stream_stream:
        return grpc.stream_stream_rpc_method_handler(streaming, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)
