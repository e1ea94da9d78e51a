"""Python client of the DiLaServe gRPC API."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import grpc

from dilaserve_jax.frontend import dilaserve_pb2 as pb
from dilaserve_jax.frontend import dilaserve_pb2_grpc as pb_grpc

DEFAULT_TARGET = "127.0.0.1:50051"


class DiLaServeClient:
    """Blocking client. `timeout` on a call becomes the gRPC deadline, which the server schedules for."""

    def __init__(self, target: str = DEFAULT_TARGET, *, auth_token: str | None = None,
                 tls_ca: str | None = None, max_message_bytes: int = 16 * 1024 * 1024):
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes)]
        if tls_ca:
            creds = grpc.ssl_channel_credentials(Path(tls_ca).read_bytes())
            self.channel = grpc.secure_channel(target, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(target, options=options)
        self.stub = pb_grpc.DiLaServeStub(self.channel)
        self._metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()

    @staticmethod
    def request(prompt: str | list[int], *, max_new_tokens: int | None = None, block_length: int | None = None,
                slo_ms: float | None = None, tau_min: float | None = None, tau_max: float | None = None,
                temperature: float = 0.0, seed: int = 0, request_id: str = "") -> pb.GenerateRequest:
        req = pb.GenerateRequest(temperature=temperature, seed=seed, request_id=request_id)
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.ids.extend(prompt)
        for name, value in (("max_new_tokens", max_new_tokens), ("block_length", block_length), ("slo_ms", slo_ms),
                            ("tau_min", tau_min), ("tau_max", tau_max)):
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
        return self.stub.ReloadWeights(req, timeout=timeout, metadata=self._metadata)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
