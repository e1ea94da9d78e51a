"""Python client of the DiLaServe gRPC API.

Calls that find the server UNAVAILABLE (still warming up, draining, or between instances) are
retried by gRPC itself, with exponential backoff, under the retry policy of the channel's service
config; retries never outlive the call's deadline.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterator

import grpc

from dilaserve_jax.frontend import dilaserve_pb2 as pb
from dilaserve_jax.frontend import dilaserve_pb2_grpc as pb_grpc

DEFAULT_TARGET = "127.0.0.1:50051"


def retry_service_config(max_attempts: int = 5, initial_backoff_s: float = 0.2, max_backoff_s: float = 5.0) -> str:
    """gRPC service config retrying UNAVAILABLE on every DiLaServe method (the server answers it while
    warming up or draining; nothing ran, so a retry is safe)."""
    if not 2 <= max_attempts <= 5:  # gRPC caps attempts at 5
        raise ValueError("max_attempts must be in [2, 5]")
    return json.dumps({"methodConfig": [{
        "name": [{"service": "dilaserve.v1.DiLaServe"}],
        "retryPolicy": {"maxAttempts": max_attempts, "initialBackoff": f"{initial_backoff_s}s",
                        "maxBackoff": f"{max_backoff_s}s", "backoffMultiplier": 2,
                        "retryableStatusCodes": ["UNAVAILABLE"]}}]})


class DiLaServeClient:
    """Blocking client. `timeout` on a call becomes the gRPC deadline, which the server schedules for.
    `admin_token` authorises ReloadWeights (and Reconfigure); `retries=False` turns retrying off."""

    def __init__(self, target: str = DEFAULT_TARGET, *, auth_token: str | None = None,
                 admin_token: str | None = None, tls_ca: str | None = None,
                 max_message_bytes: int = 16 * 1024 * 1024, retries: bool = True):
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes),
                   ("grpc.enable_retries", 1 if retries else 0)]
        if retries:
            options.append(("grpc.service_config", retry_service_config()))
        if tls_ca:
            creds = grpc.ssl_channel_credentials(Path(tls_ca).read_bytes())
            self.channel = grpc.secure_channel(target, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(target, options=options)
        self.stub = pb_grpc.DiLaServeStub(self.channel)
        self._metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()
        admin = admin_token or auth_token
        self._admin_metadata = (("authorization", f"Bearer {admin}"),) if admin else ()

    @staticmethod
    def request(prompt: str | list[int], *, max_new_tokens: int | None = None, block_length: int | None = None,
                slo_ms: float | None = None, tau_min: float | None = None, tau_max: float | None = None,
                temperature: float = 0.0, seed: int = 0, request_id: str = "",
                max_accuracy_drop: float | None = None, strict_admission: bool | None = None) -> pb.GenerateRequest:
        req = pb.GenerateRequest(temperature=temperature, seed=seed, request_id=request_id)
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.ids.extend(prompt)
        for name, value in (("max_new_tokens", max_new_tokens), ("block_length", block_length), ("slo_ms", slo_ms),
                            ("tau_min", tau_min), ("tau_max", tau_max), ("max_accuracy_drop", max_accuracy_drop),
                            ("strict_admission", strict_admission)):
            if value is not None:
                setattr(req, name, value)
        return req

    def generate(self, prompt, *, timeout: float | None = None, **kw) -> pb.GenerateResponse:
        return self.stub.Generate(self.request(prompt, **kw), timeout=timeout, metadata=self._metadata)

    def generate_stream(self, prompt, *, timeout: float | None = None, **kw) -> Iterator[pb.GenerateStreamResponse]:
        return self.stub.GenerateStream(self.request(prompt, **kw), timeout=timeout, metadata=self._metadata)

    def cluster_state(self, timeout: float | None = 10.0) -> pb.ClusterState:
        return self.stub.GetClusterState(pb.ClusterStateRequest(), timeout=timeout, metadata=self._metadata)

    def reload_weights(self, directory: str, step: int | None = None, timeout: float | None = 600.0):
        req = pb.ReloadWeightsRequest(directory=directory)
        if step is not None:
            req.step = step
        return self.stub.ReloadWeights(req, timeout=timeout, metadata=self._admin_metadata)

    def reconfigure(self, mesh: str, timeout: float | None = 600.0) -> pb.ClusterState:
        return self.stub.Reconfigure(pb.ReconfigureRequest(mesh=mesh), timeout=timeout, metadata=self._admin_metadata)

    def set_controller_mode(self, mode: str, timeout: float | None = 30.0) -> pb.ClusterState:
        """Pause ("paused") or resume ("auto") the cluster controller (admin)."""
        return self.stub.SetControllerMode(pb.ControllerModeRequest(mode=mode), timeout=timeout,
                                           metadata=self._admin_metadata)

    def wait_ready(self, timeout_s: float = 600.0, poll_s: float = 1.0) -> float:
        """Block until the server's standard health check says SERVING (it says NOT_SERVING while
        warming up or draining); returns the seconds waited. TimeoutError after `timeout_s`."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self.channel)
        t0 = time.monotonic()
        last = "no answer"
        while True:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=max(poll_s, 1.0),
                                    metadata=self._metadata).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return time.monotonic() - t0
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
            except grpc.RpcError as err:
                last = err.code().name
            if time.monotonic() - t0 >= timeout_s:
                raise TimeoutError(f"server not SERVING after {timeout_s:g} s (last: {last})")
            time.sleep(poll_s)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
