"""Slot shards: one decoder's slots split into equal contiguous ranges over D devices.

Shard d holds slots [d * S/D, (d + 1) * S/D) of every DecodeState leaf (all are slot-major) and a
full copy of the weights. A step runs as `jax.shard_map` over the SLOTS_AXIS: each device steps
its own rows against its own slots with the ordinary `decode_step`, and no step needs any
communication, because decoding never mixes rows. The step's batch is D equal parts, part d
holding shard d's rows (its slots in order, then padding), each part a bucket of the per-shard
batch buckets.

Why: on a CPU host, XLA runs a step's small operations (attention's many small products, norms,
the proposal) one after another on one core; D shards on D host devices run D such chains at
once. On an accelerator the same split is plain data parallelism over an instance's devices.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

SLOTS_AXIS = "slots"


def slot_mesh(devices: Sequence) -> Mesh:
    """A 1-D mesh over `devices` whose axis splits the slots."""
    return Mesh(np.array(list(devices), dtype=object), (SLOTS_AXIS,))


def default_slot_devices(shards: int) -> list:
    """The first `shards` local devices of the default backend (error if there are fewer)."""
    devices = jax.local_devices()
    if len(devices) < shards:
        raise ValueError(f"{shards} slot shards need {shards} devices; this process has {len(devices)} "
                         f"({devices[0].platform}). On CPU, start with "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={shards}")
    return devices[:shards]


def slot_sharding(mesh: Mesh) -> NamedSharding:
    """Every DecodeState leaf split by its leading (slot) dimension."""
    return NamedSharding(mesh, P(SLOTS_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def shards_of(sharding: Any) -> int:
    """How many slot shards a state placed with `sharding` (its canvas's) has: 1 unless it is split
    by its leading dimension over a SLOTS_AXIS."""
    if not isinstance(sharding, NamedSharding) or SLOTS_AXIS not in sharding.mesh.axis_names:
        return 1
    spec = sharding.spec
    return sharding.mesh.shape[SLOTS_AXIS] if len(spec) and spec[0] == SLOTS_AXIS else 1


def shard_rows(slots: Sequence[int], taus: Sequence[float], num_slots: int, shards: int, part: int,
               in_place: bool) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(local slot index [shards * part], τ [shards * part], batch row of each of `slots`).

    Part d of the batch holds shard d's rows. In a gathered step they are its stepped slots in
    order, then padding; in a step on the state where it lies (`in_place`, part = slots per shard)
    row r of part d is its local slot r. Local indices count from the shard's first slot; padding
    and slots not stepped carry the shard's slot count (dropped by every write)."""
    local = num_slots // shards
    index = np.full(shards * part, local, np.int32)
    tau = np.ones(shards * part, np.float32)
    rows, used = [], [0] * shards
    for slot, t in zip(slots, taus):
        shard, offset = divmod(slot, local)
        row = shard * part + (offset if in_place else used[shard])
        used[shard] += 1
        index[row], tau[row] = offset, t
        rows.append(row)
    return index, tau, rows


def per_shard_counts(slots: Sequence[int], num_slots: int, shards: int) -> list[int]:
    local = num_slots // shards
    counts = [0] * shards
    for slot in slots:
        counts[slot // local] += 1
    return counts
