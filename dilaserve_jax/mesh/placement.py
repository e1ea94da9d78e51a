"""Putting parameters into a layout: every instance gets its own sharded copy of the weights.

Checkpoints land straight in their shards: HF safetensors tensors go through
`jax.make_array_from_callback`, which hands each device only its slice of the host array, and
orbax restores into sharded abstract arrays, reading each device's slice from disk. The first
local instance is loaded from the source; the other local instances are copied from it device to
device. In a multi-process run each process holds only its own (local) instances; the entries of
other processes' instances are None.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import jax
import numpy as np

from dilaserve_jax.mesh.layout import Instance, Layout
from dilaserve_jax.mesh.reshard import move
from dilaserve_jax.mesh.sharding import param_shardings, partition_spec
from dilaserve_jax.mesh.spec import check_model
from dilaserve_jax.models.config import ModelConfig
from dilaserve_jax.models.files import build_from_json, read_json


def place_params(params, instance: Instance, cfg: ModelConfig):
    """Copy params onto `instance` with the table's shardings: device arrays device to device, host
    arrays straight into their shards."""
    def put(leaf, sharding):
        return move(leaf, sharding) if isinstance(leaf, jax.Array) else jax.device_put(leaf, sharding)

    return jax.tree_util.tree_map(put, params, param_shardings(params, instance, cfg))


def host_placer(instance: Instance, cfg: ModelConfig) -> Callable[[tuple, np.ndarray], jax.Array]:
    """A `place(path, host_array)` hook for models.hf.load_hf_params that lands each tensor sharded.

    Each device receives only its own slice, so no device ever holds a full copy on the way.
    """
    def place(path: tuple, array: np.ndarray) -> jax.Array:
        sharding = instance.sharding(partition_spec("/".join(map(str, path)), cfg, instance.tp))
        return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index], dtype=array.dtype)

    return place


def abstract_sharded_params(cfg: ModelConfig, instance: Instance):
    """(graphdef, params State of ShapeDtypeStructs carrying the instance's shardings): an orbax restore target."""
    from dilaserve_jax.models.hf import abstract_params

    graphdef, abstract = abstract_params(cfg)
    shardings = param_shardings(abstract, instance, cfg)
    sharded = jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    return graphdef, sharded


def replicate_to_instances(params, source: Instance, layout: Layout, cfg: ModelConfig) -> list:
    """Per-instance params for every instance of `layout`: `params` itself for `source`, device-to-device
    copies for the other local instances, None for instances owned by other processes."""
    result = []
    for inst in layout.instances:
        if inst == source:
            result.append(params)
        elif inst.is_local:
            result.append(place_params(params, inst, cfg))
        else:
            result.append(None)
    return result


def load_into_layout(source: str | Path, layout: Layout, *, param_dtype: str | None = None,
                     step: int | None = None, seed: int = 0):
    """Load a model (preset name, HF LLaDA directory or orbax training directory) into every local
    instance of `layout`. Returns (LoadedModel holding the first local instance's params, per-instance
    params list aligned with layout.instances)."""
    from dilaserve_jax.models import registry
    from dilaserve_jax.models.hf import config_from_hf

    local = layout.local_instances()
    if not local:
        raise ValueError(f"layout {layout} has no instance on process {jax.process_index()}")
    first = local[0]
    overrides = {"param_dtype": param_dtype} if param_dtype else {}
    name = str(source)
    directory = registry.ASSETS / "tiny" if name == "tiny" else Path(name)
    if (directory / "config.json").exists():
        cfg = config_from_hf(directory, **overrides)
        check_model(layout.spec, cfg)
        loaded = registry.load_model(directory, param_dtype=param_dtype, place=host_placer(first, cfg))
    elif (directory / registry.CONFIG_FILE).exists():
        loaded = _restore_orbax(directory, first, layout, overrides, step)
    else:  # a preset with random weights: initialised on the default device, then placed
        loaded = registry.load_model(name, param_dtype=param_dtype, seed=seed)
        check_model(layout.spec, loaded.config)
        loaded.params = place_params(loaded.params, first, loaded.config)
    return loaded, replicate_to_instances(loaded.params, first, layout, loaded.config)


def _restore_orbax(directory: Path, instance: Instance, layout: Layout, overrides: dict, step: int | None):
    from dilaserve_jax.models import registry
    from dilaserve_jax.models.checkpoint import restore_params

    data = read_json(directory / registry.CONFIG_FILE)
    tokenizer_kind = data.pop("tokenizer", "char")
    cfg = build_from_json(ModelConfig, data, directory / registry.CONFIG_FILE).replace(**overrides)
    check_model(layout.spec, cfg)
    graphdef, abstract = abstract_sharded_params(cfg, instance)
    restored_step, params = restore_params(directory, abstract, step)
    tokenizer = registry._tokenizer_for(directory, cfg, tokenizer_kind)
    return registry.LoadedModel(cfg, graphdef, params, tokenizer, f"orbax:{directory}@{restored_step}")
