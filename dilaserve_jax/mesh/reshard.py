"""Live resharding: per-instance params of one layout -> per-instance params of another.

Every instance holds the same weights, so each new instance copies from the old instance of the
same process whose devices overlap its own the most (fewest bytes to move). The copy is a single
`jax.device_put` to the new instance's shardings: device to device, never through host memory.
Old and new copies coexist until the caller drops the old ones, so a device briefly holds both.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import jax

from dilaserve_jax.models.config import ModelConfig
from dilaserve_jax.mesh.layout import Instance, Layout
from dilaserve_jax.mesh.sharding import param_shardings


@dataclass(frozen=True, slots=True)
class ReshardReport:
    """What a reshard did. bytes_moved counts shard bytes that had to arrive on a device that did not
    already hold that slice; bytes_total is the size of all new instances' shards together."""

    old_spec: str
    new_spec: str
    seconds: float
    bytes_moved: int
    bytes_total: int
    instances_copied: int  # new local instances that received at least one byte

    def __post_init__(self):
        if self.seconds < 0 or self.bytes_moved < 0 or self.bytes_moved > self.bytes_total:
            raise ValueError(f"inconsistent reshard report: {self}")

    def __str__(self) -> str:
        return (f"{self.old_spec} -> {self.new_spec}: {self.bytes_moved / 2**20:.1f} MiB moved of "
                f"{self.bytes_total / 2**20:.1f} MiB in {self.seconds * 1e3:.1f} ms")


def _source_for(new: Instance, old_layout: Layout, params_per_instance: Sequence) -> int:
    candidates = [k for k, inst in enumerate(old_layout.instances)
                  if params_per_instance[k] is not None and inst.process_index == new.process_index]
    if not candidates:
        raise ValueError(f"no old instance on process {new.process_index} holds params to fill {new}")
    new_ids = set(new.device_ids)
    return max(candidates, key=lambda k: (len(new_ids & set(old_layout.instances[k].device_ids)), -k))


def _bytes_arriving(old: jax.Array, new_sharding) -> tuple[int, int]:
    """(bytes of new shards not already present on their device in `old`, bytes of all new shards)."""
    itemsize = old.dtype.itemsize
    old_map = old.sharding.devices_indices_map(old.shape)
    moved = total = 0
    for device, index in new_sharding.devices_indices_map(old.shape).items():
        size = itemsize
        for dim, s in zip(old.shape, index):
            size *= len(range(*s.indices(dim)))
        total += size
        held = old_map.get(device)
        if held is None or not all(_covers(h, s, dim) for h, s, dim in zip(held, index, old.shape)):
            moved += size
    return moved, total


def _covers(held: slice, want: slice, dim: int) -> bool:
    h0, h1, _ = held.indices(dim)
    w0, w1, _ = want.indices(dim)
    return h0 <= w0 and w1 <= h1


def reshard(params_per_instance: Sequence, old_layout: Layout, new_layout: Layout, cfg: ModelConfig):
    """Move weights from `old_layout`'s instances to `new_layout`'s. Returns (per-instance params aligned
    with new_layout.instances, None for other processes' instances; ReshardReport).

    Blocks until every new array is ready, so the reported seconds are the real transfer time.
    """
    if len(params_per_instance) != len(old_layout.instances):
        raise ValueError(f"got params for {len(params_per_instance)} instances, old layout {old_layout.spec} has "
                         f"{len(old_layout.instances)}")
    new_layout.spec.check_model(cfg)
    plan, moved, total, copied = [], 0, 0, 0  # bookkeeping first, so the timing covers the transfers only
    for inst in new_layout.instances:
        if not inst.is_local:
            plan.append(None)
            continue
        source = params_per_instance[_source_for(inst, old_layout, params_per_instance)]
        shardings = param_shardings(source, inst, cfg)
        counts = jax.tree_util.tree_leaves(jax.tree_util.tree_map(_bytes_arriving, source, shardings),
                                           is_leaf=lambda x: isinstance(x, tuple))
        inst_moved = sum(m for m, _ in counts)
        moved, total, copied = moved + inst_moved, total + sum(t for _, t in counts), copied + (inst_moved > 0)
        plan.append((source, shardings))
    start = time.perf_counter()
    result = [None if step is None else jax.device_put(*step) for step in plan]
    jax.block_until_ready([p for p in result if p is not None])
    seconds = time.perf_counter() - start
    return result, ReshardReport(str(old_layout.spec), str(new_layout.spec), seconds, moved, total, copied)
