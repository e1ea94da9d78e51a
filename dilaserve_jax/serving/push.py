"""Weights pushed in memory (from a training job in the same process) into a serving cluster.

Two halves, so a training loop can donate its params to the next optimiser step as soon as a
push returns:

- `dispatch` (caller's thread): checks the tree against the served model, casts each leaf to
  the served dtype on the devices it lives on, and enqueues device-to-device copies of every
  parameter into the first serving instance's shardings (mesh.placement.place_params, which
  cuts each serving shard from the training shards it overlaps; no host round trip). It only
  enqueues work, so it returns quickly; JAX orders these reads before any later computation that
  donates or overwrites the source buffers.
- `complete` (a server thread): copies the first instance's new weights to the other instances
  (device to device), waits until every copy has landed, and swaps them in through
  `Cluster.swap_in` -- the same path as `ReloadWeights`. The shardings and dtypes equal the served
  ones, so no step is recompiled.

The instances are read from the cluster's InstanceInfos at each push, so pushes follow the layout
being served. Single-process clusters only (multi-host serving loads from checkpoints).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax

from dilaserve_jax.mesh.layout import Instance
from dilaserve_jax.mesh.placement import place_params
from dilaserve_jax.serving.cluster import Cluster, IncompatibleWeights, NewWeights


@dataclass(frozen=True, slots=True)
class Dispatched:
    """A push whose copies into the first instance are enqueued."""

    label: str
    first: object  # params on the first instance (arrays possibly still being copied)
    instances: tuple[tuple[str, Instance], ...]  # (name, instance) in the cluster's order


def params_of(model_or_params):
    """The params State of an nnx.Module, or the given params tree as is."""
    from flax import nnx

    if isinstance(model_or_params, nnx.Module):
        return nnx.split(model_or_params)[1]
    return model_or_params


class WeightPusher:
    def __init__(self, cluster: Cluster, model):
        """`model`: the build's ServingModel (config, per-instance params); its per_instance is kept
        current so the replaced weights can be freed."""
        if jax.process_count() > 1:
            raise ValueError("pushing weights in memory needs a single-process cluster")
        self.cluster, self.model = cluster, model
        served = next(p for p in model.per_instance if p is not None)
        self._structure = jax.tree.structure(served)
        self._avals = [(leaf.shape, leaf.dtype) for leaf in jax.tree.leaves(served)]
        self._devices = {d.id: d for d in jax.devices()}

    def dispatch(self, params, label: str) -> Dispatched:
        """Check, cast and enqueue the copies into the first instance (see the module doc)."""
        params = params_of(params)
        if jax.tree.structure(params) != self._structure:
            raise IncompatibleWeights("pushed params do not have the served model's tree structure "
                                      f"({jax.tree.structure(params).num_leaves} leaves vs {self._structure.num_leaves})")
        leaves = jax.tree.leaves(params)
        for k, (leaf, (shape, _)) in enumerate(zip(leaves, self._avals)):
            if not isinstance(leaf, jax.Array):
                raise TypeError(f"pushed params must be jax arrays on devices; leaf {k} is {type(leaf).__name__}")
            if leaf.shape != shape:
                raise IncompatibleWeights(f"pushed leaf {k} has shape {leaf.shape}, the served one {shape}")
        cast = [leaf if leaf.dtype == dtype else leaf.astype(dtype) for leaf, (_, dtype) in zip(leaves, self._avals)]
        params = jax.tree.unflatten(self._structure, cast)
        instances = tuple((info.name, Instance.over(k, [self._devices[i] for i in info.device_ids]))
                          for k, info in enumerate(self.cluster.infos))
        return Dispatched(label, place_params(params, instances[0][1], self.model.config), instances)

    def complete(self, pushed: Dispatched, timeout: float | None = 600.0, wait_s: float | None = 600.0):
        """Copy to the other instances, wait for every copy, swap in; returns the ReloadReport."""
        per_instance = [pushed.first] + [place_params(pushed.first, inst, self.model.config)
                                         for _, inst in pushed.instances[1:]]
        jax.block_until_ready(per_instance)
        new = NewWeights(pushed.label, {name: p for (name, _), p in zip(pushed.instances, per_instance)})
        report = self.cluster.swap_in(new, timeout=timeout, wait_s=wait_s, origin="push")
        self.model.per_instance, self.model.source = per_instance, pushed.label
        return report
