"""Flags of the OpenAI-compatible HTTP API (read by `serve`; no web framework imported here)."""
from __future__ import annotations

from dataclasses import dataclass

from dilaserve_jax.core.cli import opt, or_none


@dataclass(frozen=True, slots=True)
class HttpOptions:
    http_port: int | None = opt(8000, "OpenAI-compatible HTTP API port on --host (/v1/completions, "
                                      "/v1/chat/completions, /v1/models, /health, /metrics; -1 disables; 0 = any "
                                      "free port)", parse=or_none(int, "-1"))
    served_model_name: str | None = opt(None, "the model id the HTTP API lists and expects in requests' `model`",
                                        default_text="the --model preset's name, or its directory's name")

    def __post_init__(self):
        if self.http_port is not None and not 0 <= self.http_port < 65536:
            raise ValueError(f"--http-port must be in [0, 65535] (or -1), got {self.http_port}")
        if self.served_model_name is not None and not 0 < len(self.served_model_name) <= 256:
            raise ValueError("--served-model-name must have 1 to 256 characters")
