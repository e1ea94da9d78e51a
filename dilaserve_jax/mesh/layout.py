"""Layouts: a mesh spec made concrete, with devices assigned to every instance.

Each instance gets a contiguous run of neighbouring devices inside one process (on GPUs and TPUs
neighbouring ids share the fast links; across processes only the slow network is shared; the rule
is `core.layouts.place`) and a 1-D `jax.sharding.Mesh` over them with the single axis "model". The mesh is built with
`Mesh(devices, names)` on purpose: its axis is of the classic auto type, so jit propagates
shardings from the parameters instead of demanding explicit annotations (`jax.make_mesh` would
default to explicit axes in recent JAX).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dilaserve_jax.core.layouts import MODEL_AXIS, MeshSpec, MeshSpecError, place
from dilaserve_jax.mesh.spec import check_model
from dilaserve_jax.models.config import ModelConfig


@dataclass(frozen=True, slots=True)
class Instance:
    """One serving instance: `tp` devices of one process and the mesh over them."""

    index: int
    devices: tuple
    mesh: Mesh = field(compare=False, repr=False)

    def __post_init__(self):
        tp = len(self.devices)
        if tp == 0 or tp & (tp - 1):
            raise MeshSpecError(f"instance {self.index} has {tp} devices; a TP degree must be a power of two")
        if len({d.process_index for d in self.devices}) != 1:
            raise MeshSpecError(f"instance {self.index} spans processes {sorted({d.process_index for d in self.devices})}; "
                                "a TP group must stay within one process's local devices")
        if tuple(self.mesh.devices.flat) != self.devices or self.mesh.axis_names != (MODEL_AXIS,):
            raise MeshSpecError(f"instance {self.index}: mesh does not match its devices / '{MODEL_AXIS}' axis")

    @classmethod
    def over(cls, index: int, devices: Sequence) -> "Instance":
        devices = tuple(devices)
        return cls(index, devices, Mesh(np.array(devices, dtype=object), (MODEL_AXIS,)))

    @property
    def tp(self) -> int:
        return len(self.devices)

    @property
    def device_ids(self) -> tuple[int, ...]:
        return tuple(d.id for d in self.devices)

    @property
    def process_index(self) -> int:
        return self.devices[0].process_index

    @property
    def is_local(self) -> bool:
        """Whether this process can hold and run this instance's arrays."""
        return self.process_index == jax.process_index()

    def sharding(self, spec: PartitionSpec) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def __str__(self) -> str:
        ids = self.device_ids
        if len(ids) == 1:
            return f"TP1[{ids[0]}]"
        contiguous = ids == tuple(range(ids[0], ids[-1] + 1))
        return f"TP{self.tp}[{ids[0]}-{ids[-1]}]" if contiguous else f"TP{self.tp}[{','.join(map(str, ids))}]"


@dataclass(frozen=True, slots=True)
class Layout:
    """A partition of devices into instances, in the order the spec lists them."""

    spec: MeshSpec
    instances: tuple[Instance, ...]

    def __post_init__(self):
        if tuple(i.tp for i in self.instances) != self.spec.tp_degrees:
            raise MeshSpecError(f"layout instances {[i.tp for i in self.instances]} do not match spec {self.spec}")
        if any(inst.index != k for k, inst in enumerate(self.instances)):
            raise MeshSpecError("layout instance indices must be 0..n-1 in order")
        ids = [d.id for inst in self.instances for d in inst.devices]
        if len(ids) != len(set(ids)):
            raise MeshSpecError(f"layout {self.spec} uses a device twice: {sorted(ids)}")

    @classmethod
    def build(cls, spec: MeshSpec | str, devices: Sequence | None = None, *, config: ModelConfig | None = None,
              allow_unused: bool = False) -> "Layout":
        """Assign `devices` (default: all of `jax.devices()`, every process's) to the spec's instances
        by `core.layouts.place`: widest first, each into the first process with enough free devices,
        on that process's lowest free ids. With `config`, also checks the model can be sharded.
        """
        spec = MeshSpec.parse(spec) if isinstance(spec, str) else spec
        devices = list(jax.devices() if devices is None else devices)
        spec.check_device_count(len(devices), allow_unused=allow_unused)
        if config is not None:
            check_model(spec, config)
        free: dict[int, list[int]] = {}
        for d in sorted(devices, key=lambda d: (d.process_index, d.id)):
            free.setdefault(d.process_index, []).append(d.id)
        by_id = {d.id: d for d in devices}
        groups = place(spec.tp_degrees, free)
        return cls(spec, tuple(Instance.over(k, [by_id[i] for i in ids]) for k, ids in enumerate(groups)))

    @property
    def devices(self) -> tuple:
        return tuple(d for inst in self.instances for d in inst.devices)

    def local_instances(self) -> tuple[Instance, ...]:
        """The instances whose devices belong to this process (all of them in a single process)."""
        return tuple(inst for inst in self.instances if inst.is_local)

    def __str__(self) -> str:
        return f"{self.spec} = " + " + ".join(str(inst) for inst in self.instances)
