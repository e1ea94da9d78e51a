"""What a reconfiguration builds instances with: their description and the builder contract.

Pure: serving/executor/instances.py implements `InstanceBuilder` with JAX; tests and the
simulator implement as much of it as they use.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from dilaserve_jax.serving.cluster.engine import Engine


@dataclass(frozen=True, slots=True)
class InstanceInfo:
    name: str
    tp_degree: int
    device_ids: tuple[int, ...]
    host: str = ""  # the host whose devices it runs on ("" in a one-process server)


class InstanceBuilder(Protocol):
    """Builds and drops the instances of a layout (a builder that compiles may also offer
    `compile_count() -> int`, the executables built so far, for the reshape report)."""

    def plan(self, spec: str) -> list[InstanceInfo]:
        """The instances of layout `spec` (names identify TP degree + devices); ValueError if invalid."""

    def overlap_fits(self, add: Sequence[InstanceInfo]) -> bool:
        """Whether the new instances fit beside the old ones (weights and KV slots)."""

    def build(self, add: Sequence[InstanceInfo], spec: str) -> tuple[list[Engine], int, float]:
        """Engines (not started) for the new instances, weights resharded from the current ones;
        returns them with the bytes moved and the reshard seconds."""

    def prepare(self, engine: Engine) -> None:
        """After start: compile/warm and install its latency model (through its engine thread)."""

    def release(self, names: Sequence[str]) -> None:
        """Drop the weights of removed instances."""

    def compiled_placements(self) -> frozenset[tuple[int, int]]:
        """(TP degree, first device) of every placement with executables."""
