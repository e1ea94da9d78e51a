"""Hugging Face checkpoints (LLaDA or Dream): config.json + *.safetensors (single file or sharded).

Tensors are read one at a time, transposed and cast to the target dtype, and handed to `place`
(device_put by default; the mesh code passes a sharded placement), so the checkpoint is never
held twice in host memory.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from dilaserve_jax.models.config import ModelConfig
from dilaserve_jax.models.files import read_json
from dilaserve_jax.models.hf_formats import (FORMATS, CheckpointError, detect_family, dream_config, llada_config,
                                             raw_config)
from dilaserve_jax.models.llada import LLaDAModel

__all__ = ["CheckpointError", "abstract_params", "config_from_hf", "hf_key_to_param", "load_hf_params",
           "param_to_hf_key", "read_hf_config", "save_hf_checkpoint"]


def hf_key_to_param(key: str, family: str = "llada") -> tuple[tuple, bool] | None:
    """Map an HF tensor name to (parameter path, transpose?), or None if it is not ours."""
    return FORMATS[family].to_param(key)


def param_to_hf_key(path: tuple, family: str = "llada") -> tuple[str, bool]:
    return FORMATS[family].to_key(path)


def read_hf_config(path: str | Path) -> tuple[dict, str]:
    """(config.json contents, family) of an HF checkpoint directory."""
    path = Path(path)
    raw = read_json(path / "config.json")
    return raw, detect_family(raw, path / "config.json")


def config_from_hf(path: str | Path, name: str | None = None, **overrides) -> ModelConfig:
    """Build a ModelConfig from a LLaDA or Dream config.json (the family is detected)."""
    path = Path(path)
    raw, family = read_hf_config(path)
    name = name or raw.get("dilaserve_name", path.name)
    values = (dream_config if family == "dream" else llada_config)(raw, name, path / "config.json")
    values.update(overrides)
    return ModelConfig(**values)


def _shard_files(path: Path) -> dict[str, list[str]]:
    """Shard file -> the keys it holds."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index)["weight_map"]
        files: dict[str, list[str]] = {}
        for key, fname in weight_map.items():
            files.setdefault(fname, []).append(key)
        return files
    singles = sorted(p.name for p in path.glob("*.safetensors"))
    if not singles:
        raise CheckpointError(f"no *.safetensors files in {path}")
    from safetensors import safe_open

    files = {}
    for fname in singles:
        with safe_open(str(path / fname), framework="numpy") as f:
            files[fname] = list(f.keys())
    return files


def abstract_params(cfg: ModelConfig):
    """(graphdef, abstract params state) without allocating any weights."""
    model = nnx.eval_shape(lambda: LLaDAModel(cfg, rngs=nnx.Rngs(0)))
    return nnx.split(model)


def _flat_shapes(abstract_state) -> dict[tuple, jax.ShapeDtypeStruct]:
    flat = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(abstract_state)):
        flat[tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)] = leaf
    return flat


def _np_dtype(dtype: str):
    return ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32


def _tied_embeddings(path: Path, family: str) -> bool:
    """Dream configs may tie lm_head to the embedding (tie_word_embeddings; false in the released
    checkpoints); the tied head is then loaded from the embedding tensor."""
    config = path / "config.json"
    return family == "dream" and config.exists() and bool(read_json(config).get("tie_word_embeddings"))


def load_hf_params(path: str | Path, cfg: ModelConfig,
                   place: Callable[[tuple, np.ndarray], jax.Array] | None = None):
    """Load a safetensors checkpoint of cfg's family (LLaDA or Dream) into (graphdef, params) for cfg.

    place(path, array) puts one host array where it belongs (default: the default device).
    Raises CheckpointError naming the key for missing, unexpected or mis-shaped tensors.
    """
    from safetensors import safe_open

    path = Path(path)
    fmt = FORMATS[cfg.family]
    graphdef, abstract = abstract_params(cfg)
    expected = _flat_shapes(abstract)
    place = place or (lambda _p, a: jnp.asarray(a))
    target = _np_dtype(cfg.param_dtype)
    tied = _tied_embeddings(path, cfg.family)
    loaded: dict[tuple, jax.Array] = {}
    for fname, keys in _shard_files(path).items():
        with safe_open(str(path / fname), framework="numpy") as f:
            for key in keys:
                mapped = fmt.to_param(key)
                if mapped is None or mapped[0] not in expected:
                    raise CheckpointError(f"unexpected tensor {key!r} in {fname}: the {cfg.family} model "
                                          f"({'with' if cfg.qkv_bias else 'without'} q/k/v biases) has no such parameter")
                ppath, transpose = mapped
                shape = tuple(f.get_slice(key).get_shape())
                want = expected[ppath].shape
                got = shape[::-1] if transpose else shape
                if got != want:
                    torch_want = want[::-1] if transpose else want
                    raise CheckpointError(f"tensor {key!r} has shape {shape}, the model expects {torch_want}")
                array = f.get_tensor(key)
                if tied and ppath == ("wte",) and ("lm_head", "kernel") not in loaded:
                    loaded[("lm_head", "kernel")] = place(("lm_head", "kernel"),
                                                         np.ascontiguousarray(array.T).astype(target, copy=False))
                array = np.ascontiguousarray(array.T if transpose else array).astype(target, copy=False)
                loaded[ppath] = place(ppath, array)
                del array
    missing = [p for p in expected if p not in loaded]
    if missing:
        key, transpose = fmt.to_key(missing[0])
        shape = expected[missing[0]].shape
        raise CheckpointError(f"checkpoint {path} is missing tensor {key!r} (expected shape "
                              f"{shape[::-1] if transpose else shape}); {len(missing)} missing in all")
    return graphdef, _fill(abstract, loaded)


def _fill(abstract_state, flat_values: dict[tuple, jax.Array]):
    pure = nnx.to_pure_dict(abstract_state)

    def put(path, _leaf):
        return flat_values[tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)]

    pure = jax.tree_util.tree_map_with_path(put, pure)
    nnx.replace_by_pure_dict(abstract_state, pure)
    return abstract_state


def save_hf_checkpoint(path: str | Path, cfg: ModelConfig, params, *, max_shard_bytes: int | None = None,
                       extra_config: dict | None = None) -> None:
    """Write params as a checkpoint of cfg's family (LLaDA or Dream names and config.json; safetensors,
    sharded past max_shard_bytes, with the index)."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for ppath, leaf in _flat_shapes(params).items():
        key, transpose = param_to_hf_key(ppath, cfg.family)
        arr = np.asarray(jax.device_get(leaf))
        tensors[key] = np.ascontiguousarray(arr.T if transpose else arr)
    shards, current, size = [], {}, 0
    for key in sorted(tensors):
        if max_shard_bytes and current and size + tensors[key].nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[key] = tensors[key]
        size += tensors[key].nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"))
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(path / fname))
            weight_map.update({k: fname for k in shard})
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    config = raw_config(cfg)
    config.update(extra_config or {})
    (path / "config.json").write_text(json.dumps(config, indent=1))
