"""Assembles the grpc.aio server: service, health checking, reflection, auth, TLS, metrics, drain;
and, when asked, the OpenAI-compatible HTTP API beside it on the same loop (frontend/http/)."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from dilaserve_jax.core.cli import opt, or_none
from dilaserve_jax.frontend import dilaserve_pb2 as pb
from dilaserve_jax.frontend.auth import AccessInterceptor
from dilaserve_jax.frontend.calls import Calls
from dilaserve_jax.frontend.metrics import ServingMetrics
from dilaserve_jax.frontend.service import DiLaServeService

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["DiLaServe"].full_name
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ServerOptions:
    host: str = opt("127.0.0.1", "address to listen on")
    port: int = opt(50051, "gRPC port (0 = any free port)")
    metrics_port: int | None = opt(9464, "Prometheus metrics port (-1 disables; 0 = any free port)",
                                   parse=or_none(int, "-1"))  # None = no metrics endpoint
    auth_token: str | None = opt(None, "require 'authorization: Bearer TOKEN' on every call (or set "
                                       "DILASERVE_AUTH_TOKEN)", env="DILASERVE_AUTH_TOKEN")
    admin_token: str | None = opt(None, "token for the admin calls ReloadWeights and Reconfigure (or set "
                                        "DILASERVE_ADMIN_TOKEN); without it they are allowed on a loopback address "
                                        "only", env="DILASERVE_ADMIN_TOKEN")
    weights_roots: tuple[str, ...] = opt((), "a directory ReloadWeights may read from, besides the served model's "
                                             "own (repeatable)", name="--weights-root", repeat=True, metavar="DIR")
    tls_cert: str | None = opt(None, "PEM certificate chain for TLS (with --tls-key)")
    tls_key: str | None = opt(None, "PEM private key for TLS (with --tls-cert)")
    grace_s: float = opt(30.0, "on SIGINT/SIGTERM, seconds to let calls finish")
    max_message_bytes: int = MAX_MESSAGE_BYTES

    def __post_init__(self):
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key must be given together")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.grace_s < 0:
            raise ValueError("grace period must be >= 0")
        if self.auth_token == "" or self.admin_token == "":
            raise ValueError("tokens must not be empty")
        if self.auth_token is not None and self.auth_token == self.admin_token:
            raise ValueError("the admin token must differ from the inference token")


class RunningServer:
    def __init__(self, server, service: DiLaServeService, health_servicer, metrics: ServingMetrics,
                 port: int, metrics_port: int | None, grace_s: float, access: AccessInterceptor, http=None):
        self.server, self.service, self.health, self.metrics = server, service, health_servicer, metrics
        self.port, self.metrics_port, self.grace_s, self.access = port, metrics_port, grace_s, access
        self.http = http  # the HTTP API's listener (frontend/http/listener.py), or None
        self.http_port = http.port if http is not None else None
        self._wanted_serving = False

    async def set_serving(self, serving: bool) -> None:
        """SERVING only while wanted (warmed up, not draining) and some instance is alive."""
        self._wanted_serving = serving
        alive = bool(self.service.cluster.healthy_engines)
        status = health_pb2.HealthCheckResponse.SERVING if serving and alive \
            else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def refresh_health(self) -> None:
        await self.set_serving(self._wanted_serving)

    async def drain_and_stop(self, grace_s: float | None = None) -> bool:
        """NOT_SERVING, refuse new calls (gRPC and HTTP), let in-flight calls finish (up to the grace
        period), stop both."""
        grace_s = self.grace_s if grace_s is None else grace_s
        await self.set_serving(False)
        finished = await self.service.drain(grace_s)
        await self.server.stop(grace=1.0)
        if self.http is not None:
            await self.http.stop(timeout_s=1.0)
        self.metrics.close()
        return finished


class MalformedRequest:
    """Stands in for a request whose bytes did not parse, so the service can answer INVALID_ARGUMENT."""

    def __init__(self, error: Exception):
        self.error = error


def _lenient(message_type):
    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except Exception as err:  # protobuf raises DecodeError (and others for some malformed inputs)
            return MalformedRequest(err)
    return parse


def service_handlers(service: DiLaServeService):
    """Method handlers like the generated ones, but malformed bytes reach the service as MalformedRequest
    (gRPC would otherwise answer INTERNAL); unknown fields parse and are ignored, as protobuf intends."""
    methods = pb.DESCRIPTOR.services_by_name["DiLaServe"].methods_by_name
    handlers = {}
    for name, method in methods.items():
        request_type = getattr(pb, method.input_type.name)
        response_type = getattr(pb, method.output_type.name)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[name] = make(getattr(service, name), request_deserializer=_lenient(request_type),
                              response_serializer=response_type.SerializeToString)
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


async def start_server(cluster, options: ServerOptions, http=None) -> RunningServer:
    """Start listening (health NOT_SERVING until `set_serving(True)` after warm-up). `http`: an
    HttpOptions whose port is set serves the OpenAI-compatible API too, on options.host, with the
    same auth token and TLS, through the same generation path as gRPC."""
    access = AccessInterceptor(options.auth_token, options.admin_token, options.host)
    server = grpc.aio.server(interceptors=[access] if access.active else [], options=[
        ("grpc.max_receive_message_length", options.max_message_bytes),
        ("grpc.max_send_message_length", options.max_message_bytes),
    ])
    metrics = ServingMetrics(cluster)
    cluster.add_step_hook(metrics.step_hook)  # on the engines a reconfiguration builds too
    cluster.add_listener(metrics.cluster_event)
    calls = Calls(cluster, metrics)
    service = DiLaServeService(cluster, metrics, options.weights_roots, calls=calls)
    server.add_generic_rpc_handlers((service_handlers(service),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    address = f"{options.host}:{options.port}"
    if options.tls_cert:
        creds = grpc.ssl_server_credentials([(Path(options.tls_key).read_bytes(), Path(options.tls_cert).read_bytes())])
        port = server.add_secure_port(address, creds)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind {address}")
    await server.start()
    metrics_port = None
    if options.metrics_port is not None:
        metrics_port = metrics.serve_http(options.metrics_port, options.host)
    listener = None
    if http is not None and http.http_port is not None:
        from dilaserve_jax.frontend.http.app import HttpFrontend
        from dilaserve_jax.frontend.http.listener import start_http

        frontend = HttpFrontend(calls, metrics, model_id=http.served_model_name, auth_token=options.auth_token,
                                admin_token=options.admin_token)
        try:
            listener = await start_http(frontend.app, options.host, http.http_port, tls_cert=options.tls_cert,
                                        tls_key=options.tls_key)
        except BaseException:
            await server.stop(None)
            metrics.close()
            raise
    running = RunningServer(server, service, health_servicer, metrics, port, metrics_port, options.grace_s, access,
                            listener)
    loop = asyncio.get_running_loop()

    def on_cluster_event(event: str, _details: dict) -> None:  # engine or watchdog thread
        if event == "failure":
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(running.refresh_health()))
    cluster.add_listener(on_cluster_event)
    await running.set_serving(False)
    return running
