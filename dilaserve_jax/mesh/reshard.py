"""Live resharding: per-instance params of one layout -> per-instance params of another.

Every instance holds the same weights, so each new instance copies from the old instance of the
same process whose devices overlap its own the most (fewest bytes to move), device to device:

- when every new shard already exists as some old shard (same slice), or one old buffer holds the
  whole array, `jax.device_put` copies (or slices on device and copies) buffers between devices;
- when every new shard lies inside one old shard (TP 2 -> TP 4), each old shard is sliced on its
  device and the pieces copied out;
- when every new shard is a run of whole old shards (TP 4 -> TP 2 or TP 1), those shards are copied
  to the new device and concatenated there;
- when the old shards cut the array along other axes than the new ones (a training job's FSDP
  rows -> serving TP columns), each new shard is assembled from the pieces of the old shards it
  overlaps: every piece is cut on its own device, copied over, and the pieces are concatenated on
  the new device (a grid of pieces, joined axis by axis). Only the new shard's own bytes move;
- otherwise (shards that do not form a grid; no NamedSharding produces them) the old devices
  all-gather the parameter and one full copy is then sliced and copied out.
`jax.device_put` alone would handle the last three by fetching the whole array to host memory.

Old and new copies coexist until the caller drops the old ones, so a device briefly holds both (and
an all-gathered parameter, one at a time).
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dilaserve_jax.models.config import ModelConfig
from dilaserve_jax.mesh.layout import Instance, Layout
from dilaserve_jax.mesh.sharding import param_shardings
from dilaserve_jax.mesh.spec import check_model


@dataclass(frozen=True, slots=True)
class ReshardReport:
    """What a reshard did. bytes_moved counts new-shard bytes that had to arrive on a device that did not
    already hold them; bytes_gathered the extra all-gather traffic inside old instances (see the
    module doc); bytes_total is the size of all new instances' shards together, replicas included."""

    old_spec: str
    new_spec: str
    seconds: float
    bytes_moved: int
    bytes_gathered: int
    bytes_total: int
    instances_copied: int  # new local instances that received at least one byte

    def __post_init__(self):
        if self.seconds < 0 or self.bytes_moved < 0 or self.bytes_gathered < 0 or self.bytes_moved > self.bytes_total:
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


def _traffic(old: jax.Array, new_sharding) -> tuple[int, int, int]:
    """(bytes arriving on new devices that did not hold them, all-gather bytes, bytes of all new shards)."""
    old_map = old.sharding.devices_indices_map(old.shape)
    moved = total = 0
    for device, index in new_sharding.devices_indices_map(old.shape).items():
        size = _slice_bytes(old, index)
        total += size
        held = old_map.get(device)
        moved += size - (0 if held is None else _overlap_bytes(old, held, index))
    gathered = 0
    if moved and _needs_gather(old, new_sharding):
        gathered = sum(old.nbytes - _slice_bytes(old, index) for index in old_map.values())
    return moved, gathered, total


def _overlap_bytes(x: jax.Array, a, b) -> int:
    size = x.dtype.itemsize
    for dim, sa, sb in zip(x.shape, a, b):
        (a0, a1, _), (b0, b1, _) = sa.indices(dim), sb.indices(dim)
        size *= max(0, min(a1, b1) - max(a0, b0))
    return size


def _slice_bytes(x: jax.Array, index) -> int:
    size = x.dtype.itemsize
    for dim, s in zip(x.shape, index):
        size *= len(range(*s.indices(dim)))
    return size


def _covers(held: slice, want: slice, dim: int) -> bool:
    h0, h1, _ = held.indices(dim)
    w0, w1, _ = want.indices(dim)
    return h0 <= w0 and w1 <= h1


def _normalized(index, shape) -> tuple:
    return tuple(s.indices(dim) for s, dim in zip(index, shape))


def _old_shards_match(old: jax.Array, new_sharding) -> bool:
    """Does every new shard's slice exist as a whole shard of `old` (so buffers can be copied as they are)?"""
    held = {_normalized(index, old.shape) for index in old.sharding.devices_indices_map(old.shape).values()}
    return all(_normalized(index, old.shape) in held for index in new_sharding.devices_indices_map(old.shape).values())


def _split_plan(old: jax.Array, new_sharding) -> list | None:
    """When every new shard lies inside one old shard (e.g. TP 2 -> TP 4): [(old shard buffer, sharding of
    that buffer over the new devices it feeds)], so each old shard is sliced on its device and copied
    out; None when a new shard needs pieces of several old shards (e.g. TP 4 -> TP 2)."""
    if not isinstance(new_sharding, NamedSharding) or len(new_sharding.mesh.axis_names) != 1:
        return None
    old_shards = old.addressable_shards
    groups: dict[int, tuple] = {}  # old shard number -> (its buffer, {new device: slice of the buffer it needs})
    for device, want in new_sharding.devices_indices_map(old.shape).items():
        covering = [k for k, s in enumerate(old_shards) if all(_covers(h, w, n) for h, w, n in zip(s.index, want, old.shape))]
        if not covering:
            return None
        k = next((k for k in covering if old_shards[k].device == device), covering[0])
        starts = tuple(h.indices(n)[0] for h, n in zip(old_shards[k].index, old.shape))
        rel = tuple((a - o, b - o) for (a, b, _), o in zip(_normalized(want, old.shape), starts))
        groups.setdefault(k, (old_shards[k].data, {}))[1][device] = rel
    plan = []
    for buffer, wanted in groups.values():
        mesh = Mesh(np.array(list(wanted), dtype=object), new_sharding.mesh.axis_names)
        sub = NamedSharding(mesh, new_sharding.spec)
        got = {d: tuple((a, b) for a, b, _ in _normalized(i, buffer.shape))
               for d, i in sub.devices_indices_map(buffer.shape).items()}
        if got != wanted:
            return None
        plan.append((buffer, sub))
    return plan


def _merge_plan(old: jax.Array, new_sharding) -> dict | None:
    """When every new shard is a run of whole old shards along one axis (e.g. TP 4 -> TP 2, or split ->
    replicated): {new device: (axis, old shard buffers in order)}; None otherwise."""
    old_shards = old.addressable_shards
    plan = {}
    for device, want in new_sharding.devices_indices_map(old.shape).items():
        want_n = _normalized(want, old.shape)
        inside: dict[tuple, object] = {}  # distinct old slice -> one buffer holding it (same device preferred)
        for s in old_shards:
            if all(_covers(w, h, n) for w, h, n in zip(want, s.index, old.shape)):
                idx = _normalized(s.index, old.shape)
                if idx not in inside or s.device == device:
                    inside[idx] = s.data
        axes = {a for idx in inside for a in range(old.ndim) if idx[a] != want_n[a]}
        if len(axes) != 1:
            return None
        (axis,) = axes
        order = sorted(inside, key=lambda idx: idx[axis][0])
        bounds = [want_n[axis][0]] + [idx[axis][1] for idx in order]
        if [idx[axis][0] for idx in order] != bounds[:-1] or bounds[-1] != want_n[axis][1]:
            return None
        plan[device] = (axis, [inside[idx] for idx in order])
    return plan


def _piece_plan(old: jax.Array, new_sharding) -> dict | None:
    """{new device: [(box of the new shard's piece, old buffer holding it, slice of that buffer)]}
    when the distinct old shards overlapping every new shard tile it as a grid; None otherwise."""
    held: dict[tuple, object] = {}  # distinct old slice -> one buffer holding it
    for s in old.addressable_shards:
        held.setdefault(_normalized(s.index, old.shape), s)
    plan = {}
    for device, want in new_sharding.devices_indices_map(old.shape).items():
        want_n = _normalized(want, old.shape)
        pieces, volume = [], 0
        for box, shard in held.items():
            cut = tuple((max(h0, w0), min(h1, w1)) for (h0, h1, _), (w0, w1, _) in zip(box, want_n))
            if any(a >= b for a, b in cut):
                continue
            same_device = next((s for s in old.addressable_shards if s.device == device
                                and _normalized(s.index, old.shape) == box), shard)
            local = tuple(slice(a - h0, b - h0) for (a, b), (h0, _, _) in zip(cut, box))
            pieces.append((cut, same_device.data, local))
            volume += int(np.prod([b - a for a, b in cut]))
        if volume != int(np.prod([b - a for a, b, _ in want_n])) or _grid_order(
                [p[0] for p in pieces], old.ndim) is None:
            return None
        plan[device] = pieces
    return plan


def _grid_order(boxes: list[tuple], ndim: int):
    """Nested [(axis, [sub-orders])] that joins `boxes` axis by axis; None if they are no grid."""
    if len(boxes) == 1:
        return 0
    for axis in range(ndim):
        ranges = sorted({b[axis] for b in boxes})
        if len(ranges) == 1:
            continue
        if any(r[1] != nxt[0] for r, nxt in zip(ranges, ranges[1:])):
            return None  # overlapping or gapped ranges along this axis
        groups = [[k for k, b in enumerate(boxes) if b[axis] == r] for r in ranges]
        subs = [_grid_order([boxes[k] for k in g], ndim) for g in groups]
        if any(s is None for s in subs):
            return None
        return axis, list(zip(groups, subs))
    return None  # several boxes with equal ranges on every axis: duplicates


def _join(arrays: list, order):
    if order == 0:
        return arrays[0]
    axis, parts = order
    return jnp.concatenate([_join([arrays[k] for k in group], sub) for group, sub in parts], axis=axis)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _cut(x, starts: tuple, stops: tuple):
    """A static slice, run where `x` lives (eager lax.slice would send its bounds from the host)."""
    return jax.lax.slice(x, starts, stops)


def _assemble(pieces: list, device) -> jax.Array:
    """Cut each piece on its own device, copy it to `device`, join the grid there."""
    arrays = []
    for _box, buffer, local in pieces:
        whole = all(s.start == 0 and s.stop == n for s, n in zip(local, buffer.shape))
        cut = buffer if whole else _cut(buffer, tuple(s.start for s in local), tuple(s.stop for s in local))
        arrays.append(jax.device_put(cut, device))
    return _join(arrays, _grid_order([p[0] for p in pieces], pieces[0][1].ndim))


@functools.lru_cache(maxsize=64)
def _all_gather_on(mesh: Mesh):
    return jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, PartitionSpec()))


def _mesh_of(sharding) -> Mesh:
    if isinstance(sharding, NamedSharding):
        return sharding.mesh
    return Mesh(np.array(sorted(sharding.device_set, key=lambda d: d.id), dtype=object), ("gather",))


def _needs_gather(old: jax.Array, new_sharding) -> bool:
    return not (len(old.sharding.device_set) == 1 or old.sharding.is_fully_replicated
                or _old_shards_match(old, new_sharding) or _split_plan(old, new_sharding) is not None
                or _merge_plan(old, new_sharding) is not None or _piece_plan(old, new_sharding) is not None)


def move(old: jax.Array, new_sharding) -> jax.Array:
    """`old` re-laid out as `new_sharding` (any devices of this process), never through host memory."""
    if len(old.sharding.device_set) == 1 or _old_shards_match(old, new_sharding):
        return jax.device_put(old, new_sharding)  # whole buffers copied, or one buffer sliced on device
    if old.sharding.is_fully_replicated:
        shards = old.addressable_shards
        full = next((s.data for s in shards if s.device in new_sharding.device_set), shards[0].data)
        return jax.device_put(full, new_sharding)
    plan = _split_plan(old, new_sharding)
    if plan is not None:
        pieces = {s.device: s.data for buffer, sub in plan for s in jax.device_put(buffer, sub).addressable_shards}
    elif (merge := _merge_plan(old, new_sharding)) is not None:  # copy the old shards over, join them there
        pieces = {d: jnp.concatenate([jax.device_put(b, d) for b in buffers], axis=axis)
                  for d, (axis, buffers) in merge.items()}
    elif (grid := _piece_plan(old, new_sharding)) is not None:  # cut, copy and join the overlapping pieces
        pieces = {d: _assemble(parts, d) for d, parts in grid.items()}
    else:  # no regular structure: all-gather inside the old instance first
        return move(_all_gather_on(_mesh_of(old.sharding))(old), new_sharding)
    return jax.make_array_from_single_device_arrays(old.shape, new_sharding, [pieces[d] for d in new_sharding.addressable_devices])


def move_params(params, shardings):
    """`move` over a params tree and a matching tree of shardings."""
    return jax.tree_util.tree_map(move, params, shardings)


def reshard(params_per_instance: Sequence, old_layout: Layout, new_layout: Layout, cfg: ModelConfig):
    """Move weights from `old_layout`'s instances to `new_layout`'s. Returns (per-instance params aligned
    with new_layout.instances, None for other processes' instances; ReshardReport).

    Blocks until every new array is ready, so the reported seconds are the real transfer time.
    """
    if len(params_per_instance) != len(old_layout.instances):
        raise ValueError(f"got params for {len(params_per_instance)} instances, old layout {old_layout.spec} has "
                         f"{len(old_layout.instances)}")
    check_model(new_layout.spec, cfg)
    plan, moved, gathered, total, copied = [], 0, 0, 0, 0  # bookkeeping first: the timing covers transfers only
    for inst in new_layout.instances:
        if not inst.is_local:
            plan.append(None)
            continue
        source = params_per_instance[_source_for(inst, old_layout, params_per_instance)]
        shardings = param_shardings(source, inst, cfg)
        counts = jax.tree_util.tree_leaves(jax.tree_util.tree_map(_traffic, source, shardings),
                                           is_leaf=lambda x: isinstance(x, tuple))
        inst_moved = sum(c[0] for c in counts)
        moved, copied = moved + inst_moved, copied + (inst_moved > 0)
        gathered, total = gathered + sum(c[1] for c in counts), total + sum(c[2] for c in counts)
        plan.append((source, shardings))
    start = time.perf_counter()
    result = [None if step is None else move_params(*step) for step in plan]
    jax.block_until_ready([p for p in result if p is not None])
    seconds = time.perf_counter() - start
    return result, ReshardReport(str(old_layout.spec), str(new_layout.spec), seconds, moved, gathered, total, copied)
