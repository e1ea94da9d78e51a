"""LLaDA-format Hugging Face checkpoints: config.json + *.safetensors (single file or sharded).

Tensors are read one at a time, transposed and cast to the target dtype, and handed to `place`
(device_put by default; the mesh code passes a sharded placement), so the checkpoint is never
held twice in host memory.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from dilaserve_jax.models.config import ModelConfig
from dilaserve_jax.models.files import read_json
from dilaserve_jax.models.llada import LLaDAModel

# The one name table: HF key pattern -> (our parameter path, transpose torch [out, in] -> [in, out]).
_BLOCK_PARAMS = {
    "attn_norm": ("attn_norm", "weight", False),
    "ff_norm": ("ff_norm", "weight", False),
    "q_proj": ("q_proj", "kernel", True),
    "k_proj": ("k_proj", "kernel", True),
    "v_proj": ("v_proj", "kernel", True),
    "attn_out": ("attn_out", "kernel", True),
    "ff_proj": ("ff_proj", "kernel", True),
    "up_proj": ("up_proj", "kernel", True),
    "ff_out": ("ff_out", "kernel", True),
}
_TOP_PARAMS = {
    "model.transformer.wte.weight": (("wte",), False),
    "model.transformer.ln_f.weight": (("ln_f", "weight"), False),
    "model.transformer.ff_out.weight": (("lm_head", "kernel"), True),
}
_BLOCK_KEY = re.compile(r"^model\.transformer\.blocks\.(\d+)\.(\w+)\.weight$")


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: names the key and the shapes involved."""


def hf_key_to_param(key: str) -> tuple[tuple, bool] | None:
    """Map an HF tensor name to (parameter path, transpose?), or None if it is not ours."""
    if key in _TOP_PARAMS:
        return _TOP_PARAMS[key]
    m = _BLOCK_KEY.match(key)
    if m and m.group(2) in _BLOCK_PARAMS:
        module, leaf, transpose = _BLOCK_PARAMS[m.group(2)]
        return ("blocks", int(m.group(1)), module, leaf), transpose
    return None


def param_to_hf_key(path: tuple) -> tuple[str, bool]:
    for key, (p, transpose) in _TOP_PARAMS.items():
        if p == path:
            return key, transpose
    if path[0] == "blocks":
        for name, (module, leaf, transpose) in _BLOCK_PARAMS.items():
            if (module, leaf) == tuple(path[2:]):
                return f"model.transformer.blocks.{path[1]}.{name}.weight", transpose
    raise KeyError(f"parameter {path} has no checkpoint name")


def config_from_hf(path: str | Path, name: str | None = None, **overrides) -> ModelConfig:
    """Build a ModelConfig from a LLaDA config.json."""
    path = Path(path)
    raw = read_json(path / "config.json")
    d_model, n_heads = raw["d_model"], raw["n_heads"]
    mlp = raw.get("mlp_hidden_size") or int(raw.get("mlp_ratio", 4) * d_model)
    values = dict(
        name=name or raw.get("dilaserve_name", path.name),
        vocab_size=raw.get("embedding_size") or raw["vocab_size"],
        d_model=d_model, n_layers=raw["n_layers"], n_heads=n_heads,
        n_kv_heads=raw.get("n_kv_heads") or n_heads, head_dim=raw.get("head_dim") or d_model // n_heads,
        mlp_hidden=mlp, max_len=raw.get("max_sequence_length", 4096),
        mask_id=raw.get("mask_token_id", 126336), eos_id=raw.get("eos_token_id", 126081),
        pad_id=raw.get("pad_token_id", raw.get("eos_token_id", 126081)),
        rope_theta=float(raw.get("rope_theta", 10000.0)), rms_eps=float(raw.get("rms_norm_eps", 1e-5)),
    )
    if raw.get("include_bias") or raw.get("weight_tying"):
        raise CheckpointError("checkpoints with biases or tied embeddings are not supported")
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


def load_hf_params(path: str | Path, cfg: ModelConfig,
                   place: Callable[[tuple, np.ndarray], jax.Array] | None = None):
    """Load a LLaDA safetensors checkpoint into (graphdef, params) for cfg.

    place(path, array) puts one host array where it belongs (default: the default device).
    Raises CheckpointError naming the key for missing, unexpected or mis-shaped tensors.
    """
    from safetensors import safe_open

    path = Path(path)
    graphdef, abstract = abstract_params(cfg)
    expected = _flat_shapes(abstract)
    place = place or (lambda _p, a: jnp.asarray(a))
    target = _np_dtype(cfg.param_dtype)
    loaded: dict[tuple, jax.Array] = {}
    for fname, keys in _shard_files(path).items():
        with safe_open(str(path / fname), framework="numpy") as f:
            for key in keys:
                mapped = hf_key_to_param(key)
                if mapped is None or mapped[0] not in expected:
                    raise CheckpointError(f"unexpected tensor {key!r} in {fname}: the model has no such parameter")
                ppath, transpose = mapped
                shape = tuple(f.get_slice(key).get_shape())
                want = expected[ppath].shape
                got = shape[::-1] if transpose else shape
                if got != want:
                    torch_want = want[::-1] if transpose else want
                    raise CheckpointError(f"tensor {key!r} has shape {shape}, the model expects {torch_want}")
                array = f.get_tensor(key)
                array = np.ascontiguousarray(array.T if transpose else array).astype(target, copy=False)
                loaded[ppath] = place(ppath, array)
                del array
    missing = [param_to_hf_key(p)[0] for p in expected if p not in loaded]
    if missing:
        p = next(p for p in expected if param_to_hf_key(p)[0] == missing[0])
        shape = expected[p].shape
        raise CheckpointError(f"checkpoint {path} is missing tensor {missing[0]!r} (expected shape "
                              f"{shape[::-1] if param_to_hf_key(p)[1] else shape}); {len(missing)} missing in all")
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
    """Write params as a LLaDA-format checkpoint (config.json + safetensors, sharded past max_shard_bytes)."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for ppath, leaf in _flat_shapes(params).items():
        key, transpose = param_to_hf_key(ppath)
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
    config = {
        "model_type": "llada", "d_model": cfg.d_model, "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim, "n_layers": cfg.n_layers, "mlp_hidden_size": cfg.mlp_hidden,
        "vocab_size": cfg.vocab_size, "embedding_size": cfg.vocab_size, "max_sequence_length": cfg.max_len,
        "mask_token_id": cfg.mask_id, "eos_token_id": cfg.eos_id, "pad_token_id": cfg.pad_id,
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_eps, "include_bias": False, "weight_tying": False,
        "torch_dtype": cfg.param_dtype, "dilaserve_name": cfg.name,
    }
    config.update(extra_config or {})
    (path / "config.json").write_text(json.dumps(config, indent=1))
