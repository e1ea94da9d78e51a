"""Weights pushed in memory (from a training job in the same process) into a serving cluster.

Two halves, so a training loop can donate its params to the next optimiser step as soon as a
push returns:

- `dispatch` (caller's thread): checks the tree against the served model and enqueues the copy of
  every parameter into the first serving instance, cast to the served dtype on the way
  (mesh.transfer.TransferPlan: each serving shard is cut from the training shards it overlaps,
  device to device, no host round trip, in a handful of JAX calls; plans are kept per sharding,
  so only a push with new shardings builds and compiles one). It only enqueues work, so it returns
  quickly; JAX orders these reads before any later computation that donates or overwrites the
  source buffers.
- `complete` (a server thread): copies the first instance's new weights to the other instances
  (device to device), waits until every copy has landed, then -- while no reload or
  reconfiguration can start -- makes them the builder's current weights and swaps them in through
  `Cluster.swap_in`, the path of `ReloadWeights`. Shardings and dtypes equal the served ones, so no
  step is recompiled. If a reconfiguration changed the layout meanwhile, the new weights are
  placed on the new instances (from the first copy) and swapped in there.

Single-process clusters only (multi-host serving loads from checkpoints).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax

from dilaserve_jax.mesh.layout import Instance, Layout
from dilaserve_jax.mesh.sharding import param_shardings
from dilaserve_jax.mesh.transfer import TransferPlan
from dilaserve_jax.serving.cluster.cluster import Cluster
from dilaserve_jax.serving.cluster.weights_swap import IncompatibleWeights, WeightsError


def params_of(model_or_params):
    """The params State of an nnx.Module, or the given params tree as is."""
    from flax import nnx

    if isinstance(model_or_params, nnx.Module):
        return nnx.split(model_or_params)[1]
    return model_or_params


class PlanCache:
    """TransferPlans by (source placement, destination instance, dtypes)."""

    def __init__(self, model_cfg):
        self.model_cfg = model_cfg
        self._plans: dict[tuple, TransferPlan] = {}
        self._targets: dict[tuple, list] = {}

    def place(self, params, instance: Instance, dtypes=None):
        """`params` copied onto `instance` with the sharding table's shardings (cast to `dtypes`, one per
        leaf, when given); asynchronous."""
        leaves, tree = jax.tree.flatten(params)
        tkey = (tree, instance.device_ids)
        if tkey not in self._targets:
            self._targets[tkey] = jax.tree.leaves(param_shardings(params, instance, self.model_cfg))
        targets = self._targets[tkey]
        dtypes = tuple(dtypes) if dtypes is not None else tuple(x.dtype for x in leaves)
        key = (tuple((x.shape, x.dtype, x.sharding) for x in leaves), instance.device_ids, dtypes)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = TransferPlan([(x.shape, x.dtype, x.sharding) for x in leaves], targets, dtypes)
        return jax.tree.unflatten(tree, plan(leaves))


@dataclass(frozen=True, slots=True)
class Dispatched:
    """A push whose copies into the first instance are enqueued."""

    label: str
    first: object  # params on `instance` (arrays possibly still being copied)
    instance: Instance
    layout: Layout  # the builder's layout when the push was dispatched


class WeightPusher:
    def __init__(self, cluster: Cluster, plans: PlanCache | None = None):
        if jax.process_count() > 1:
            raise ValueError("pushing weights in memory needs a single-process cluster")
        if cluster.builder is None:
            raise ValueError("this cluster has no instance builder to push weights through")
        self.cluster, self.builder = cluster, cluster.builder
        self.plans = plans or PlanCache(self.builder.model.config)
        served = next(iter(self.builder.params.values()))
        self._structure = jax.tree.structure(served)
        self._avals = [(leaf.shape, leaf.dtype) for leaf in jax.tree.leaves(served)]

    def dispatch(self, params, label: str) -> Dispatched:
        """Check, cast and enqueue the copies into the first instance (see the module doc)."""
        params = params_of(params)
        if jax.tree.structure(params) != self._structure:
            got = jax.tree.structure(params).num_leaves
            raise IncompatibleWeights("pushed params do not have the served model's tree structure "
                                      f"({got} leaves vs {self._structure.num_leaves})")
        for k, (leaf, (shape, _)) in enumerate(zip(jax.tree.leaves(params), self._avals)):
            if not isinstance(leaf, jax.Array):
                raise TypeError(f"pushed params must be jax arrays on devices; leaf {k} is {type(leaf).__name__}")
            if leaf.shape != shape:
                raise IncompatibleWeights(f"pushed leaf {k} has shape {leaf.shape}, the served one {shape}")
        layout = self.builder.layout
        first = layout.local_instances()[0]
        placed = self.plans.place(params, first, [dtype for _, dtype in self._avals])
        return Dispatched(label, placed, first, layout)

    def complete(self, pushed: Dispatched, timeout: float | None = 600.0, wait_s: float | None = 600.0,
                 attempts: int = 3):
        """Copy to the other instances, wait for every copy, swap in; returns the ReloadReport."""
        from dilaserve_jax.serving.executor.instances import instance_name

        for _ in range(attempts):
            layout = self.builder.layout
            placed = {instance_name(inst): pushed.first if inst.device_ids == pushed.instance.device_ids
                      else self.plans.place(pushed.first, inst) for inst in layout.local_instances()}
            jax.block_until_ready(placed)
            try:
                return self.cluster.swap_in(lambda: self.builder.adopt(placed, pushed.label, layout),
                                            timeout=timeout, wait_s=wait_s, origin="push")
            except WeightsError:
                if self.builder.layout is layout:
                    raise
                # reshaped meanwhile: place on the new instances and try again
        raise WeightsError(f"the layout changed {attempts} times during one push")
