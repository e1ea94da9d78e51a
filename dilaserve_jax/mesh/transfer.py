"""A whole params tree moved to other shardings on other devices in a handful of dispatches.

`mesh.reshard.move` handles one array at a time: every piece it cuts, copies and joins is its own
JAX call. For a tree of weights that is hundreds of calls, and each one hands the GIL back and
forth, so a thread doing it beside busy threads (a serving engine, gRPC workers) waits seconds for
what takes milliseconds alone. A `TransferPlan` works out once, from the shardings only, which
piece of which source shard each destination shard is made of (the grid of overlaps
`mesh.reshard` uses), and then runs every push as:

1. one jitted call per source device that cuts (and casts, if asked) every piece it holds;
2. one batched `jax.device_put` that copies all pieces to their destination devices;
3. one jitted call per destination device that joins each shard from its pieces;
4. `jax.make_array_from_single_device_arrays` per leaf, which only wraps the shards.

A destination shard that is one whole source shard (same slice, same dtype) is only copied.

Everything stays on devices; nothing passes through host memory. Plans are built for fixed
shardings, shapes and dtypes (check `matches` before reuse).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import jax
import numpy as np

from dilaserve_jax.mesh.reshard import _grid_order, _join, _normalized


@dataclass(frozen=True, slots=True)
class _Piece:
    leaf: int
    src: object  # device holding the piece's source shard
    box: tuple  # ((start, stop), ...) of the piece in the array
    local: tuple  # slice of the source shard it is cut from
    whole: bool  # the piece is the whole source shard


class TransferPlan:
    def __init__(self, sources: Sequence[tuple[tuple, object, object]], targets: Sequence,
                 dtypes: Sequence | None = None):
        """`sources`: per leaf (shape, dtype, sharding) of the input; `targets`: per leaf the output
        sharding; `dtypes`: per leaf the output dtype (default: unchanged)."""
        if len(sources) != len(targets):
            raise ValueError(f"{len(sources)} source leaves for {len(targets)} target shardings")
        self.sources, self.targets = tuple(sources), tuple(targets)
        self.dtypes = tuple(dtypes) if dtypes is not None else tuple(dt for _, dt, _ in sources)
        self._shards: list[dict] = []  # per leaf: destination device -> (pieces, grid order)
        for k, ((shape, _, src), dst) in enumerate(zip(self.sources, self.targets)):
            self._shards.append(self._plan_leaf(k, shape, src, dst))
        self._build_calls()

    @staticmethod
    def _plan_leaf(k: int, shape: tuple, src, dst) -> dict:
        held: dict[tuple, object] = {}  # distinct source box -> a device holding it
        by_device = src.devices_indices_map(shape)
        for device, index in sorted(by_device.items(), key=lambda kv: kv[0].id):
            held.setdefault(_normalized(index, shape), device)
        plan = {}
        for device, want in dst.devices_indices_map(shape).items():
            want_n = _normalized(want, shape)
            pieces = []
            for box, holder in held.items():
                if _normalized(by_device.get(device, ()), shape) == box:
                    holder = device  # this destination already holds that piece: no copy
                cut = tuple((max(h0, w0), min(h1, w1)) for (h0, h1, _), (w0, w1, _) in zip(box, want_n))
                if any(a >= b for a, b in cut):
                    continue
                local = tuple((a - h0, b - h0) for (a, b), (h0, _, _) in zip(cut, box))
                whole = all(a == h0 and b == h1 for (a, b), (h0, h1, _) in zip(cut, box))
                pieces.append(_Piece(k, holder, cut, local, whole))
            order = _grid_order([p.box for p in pieces], len(shape))
            volume = sum(int(np.prod([b - a for a, b in p.box])) for p in pieces)
            if order is None or volume != int(np.prod([b - a for a, b, _ in want_n])):
                raise ValueError(f"leaf {k}: the source shards do not tile destination shard {want_n} as a grid")
            plan[device] = (pieces, order)
        return plan

    def _build_calls(self) -> None:
        cuts: dict[object, list[_Piece]] = {}  # source device -> pieces to cut or cast there
        for k, shards in enumerate(self._shards):
            cast = self.dtypes[k] != self.sources[k][1]
            for pieces, _ in shards.values():
                for p in pieces:
                    if not p.whole or cast:
                        cuts.setdefault(p.src, []).append(p)
        self._cut_calls = []  # (device, [(leaf, piece)], jitted fn over the leaf shards it reads)
        for device, pieces in cuts.items():
            leaves = sorted({p.leaf for p in pieces})
            slot = {leaf: j for j, leaf in enumerate(leaves)}
            specs = [(slot[p.leaf], tuple(a for a, _ in p.local), tuple(b for _, b in p.local), self.dtypes[p.leaf])
                     for p in pieces]

            def cut(*shards, specs=specs):
                return tuple(jax.lax.slice(shards[j], st, sp).astype(dt) for j, st, sp, dt in specs)

            self._cut_calls.append((device, leaves, pieces, jax.jit(cut)))
        self._join_calls = []  # (device, [(leaf, pieces, order)], jitted fn)
        by_device: dict[object, list] = {}
        for k, shards in enumerate(self._shards):
            for device, (pieces, order) in shards.items():
                if len(pieces) > 1:  # a shard of one piece is that piece as it arrived: nothing to join
                    by_device.setdefault(device, []).append((k, pieces, order))
        for device, items in by_device.items():
            orders = [order for _, _, order in items]
            counts = [len(pieces) for _, pieces, _ in items]

            def join(*flat, orders=orders, counts=counts):
                out, at = [], 0
                for order, n in zip(orders, counts):
                    out.append(_join(list(flat[at:at + n]), order))
                    at += n
                return tuple(out)

            self._join_calls.append((device, items, jax.jit(join)))

    def matches(self, leaves: Sequence[jax.Array]) -> bool:
        """Were these inputs what the plan was built for (shape, dtype, sharding per leaf)?"""
        return len(leaves) == len(self.sources) and all(
            (x.shape, x.dtype, x.sharding) == (shape, dtype, sharding)
            for x, (shape, dtype, sharding) in zip(leaves, self.sources))

    def __call__(self, leaves: Sequence[jax.Array]) -> list[jax.Array]:
        """The leaves re-laid out as the targets (asynchronous: returns once everything is enqueued)."""
        if not self.matches(leaves):
            raise ValueError("inputs differ from the shapes, dtypes or shardings this plan was built for")
        shard_of = [{s.device: s.data for s in x.addressable_shards} for x in leaves]
        made: dict[int, jax.Array] = {}  # id(piece) -> the piece on its source device
        for device, cut_leaves, pieces, fn in self._cut_calls:
            for p, out in zip(pieces, fn(*[shard_of[k][device] for k in cut_leaves])):
                made[id(p)] = out
        moves, where = [], []  # (array, destination device) of every piece that changes device
        for k, shards in enumerate(self._shards):
            for device, (pieces, _) in shards.items():
                for p in pieces:
                    array = made.get(id(p), shard_of[k][p.src] if p.whole else None)
                    moves.append(array)
                    where.append(device)
        arrived = iter(jax.device_put(moves, where))  # one batched call; same-device puts are no-ops
        placed: dict[int, jax.Array] = {}
        for k, shards in enumerate(self._shards):
            for device, (pieces, _) in shards.items():
                for p in pieces:
                    placed[id(p)] = next(arrived)
        per_leaf: list[dict] = [{d: placed[id(pieces[0])] for d, (pieces, _) in shards.items() if len(pieces) == 1}
                                for shards in self._shards]
        for device, items, fn in self._join_calls:
            outs = fn(*[placed[id(p)] for _, pieces, _ in items for p in pieces])
            for (k, _, _), shard in zip(items, outs):
                per_leaf[k][device] = shard
        return [jax.make_array_from_single_device_arrays(
                    shape, target, [per_leaf[k][d] for d in target.addressable_devices_indices_map(shape)])
                for k, ((shape, _, _), target) in enumerate(zip(self.sources, self.targets))]
