"""Compiled step functions cached per (TP degree, device ids, bucket).

jit's own cache lives on the jitted function object and is keyed on the argument shardings;
keeping executables here instead makes the reuse explicit and countable: after a layout switch
and back, every instance finds its executables again and `misses` does not grow.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable

from dilaserve_jax.mesh.layout import Instance


@dataclass(frozen=True, slots=True)
class CompileKey:
    """What a compiled step depends on besides the model: where it runs and which shape bucket."""

    tp: int
    device_ids: tuple[int, ...]
    bucket: Hashable  # e.g. ("refresh", batch, length); whatever the runner buckets on

    def __post_init__(self):
        if self.tp != len(self.device_ids):
            raise ValueError(f"TP {self.tp} does not match {len(self.device_ids)} device ids {self.device_ids}")

    @classmethod
    def of(cls, instance: Instance, bucket: Hashable) -> "CompileKey":
        return cls(instance.tp, instance.device_ids, bucket)


class CompileCache:
    """Maps CompileKey -> compiled function; `build` runs only on a miss."""

    def __init__(self):
        self._compiled: dict[CompileKey, Any] = {}
        self.hits = 0
        self.misses = 0

    def get(self, instance: Instance, bucket: Hashable, build: Callable[[], Any]) -> Any:
        """The compiled function for (instance, bucket), building it with build() the first time."""
        key = CompileKey.of(instance, bucket)
        if key in self._compiled:
            self.hits += 1
        else:
            self.misses += 1
            self._compiled[key] = build()
        return self._compiled[key]

    def __len__(self) -> int:
        return len(self._compiled)

    def __contains__(self, key: CompileKey) -> bool:
        return key in self._compiled

    def keys(self) -> list[CompileKey]:
        return list(self._compiled)
