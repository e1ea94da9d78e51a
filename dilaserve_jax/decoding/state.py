"""DecodeState: the device-resident canvases and K/V caches of S request slots (sized by `models.memory`).

The K/V cache is a tuple with one LayerKV(k, v) per layer, each [S, L, kv_heads, head_dim], rather
than one stacked [layers, S, L, ...] array: the model consumes a per-layer sequence directly, each
layer's buffer is donated and updated in place on its own, and a kv-head sharding rule is the same
PartitionSpec for every leaf.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dilaserve_jax.models.config import ModelConfig
from dilaserve_jax.models.llada import LayerKV


@struct.dataclass
class DecodeState:
    """Per-slot decoding state. Positions are absolute canvas indices (prompt starts at 0)."""

    canvas: jax.Array  # [S, L] int32 tokens; the mask token marks undecided answer positions
    kv: tuple[LayerKV, ...]  # per layer, post-RoPE K/V [S, L, KVH, D]; () in cache mode none
    prompt_len: jax.Array  # [S] int32
    answer_len: jax.Array  # [S] int32
    block_start: jax.Array  # [S] int32 absolute position of the current block
    block_len: jax.Array  # [S] int32
    temperature: jax.Array  # [S] float32; 0 = greedy
    seed: jax.Array  # [S] uint32 sampling seed
    steps: jax.Array  # [S] int32 steps taken; folded into the sampling key so each step draws anew

    @property
    def num_slots(self) -> int:
        return self.canvas.shape[0]

    @property
    def length(self) -> int:
        return self.canvas.shape[1]


def _kv_dtype(cfg: ModelConfig):
    return jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32


def init_state(cfg: ModelConfig, num_slots: int, length: int, *, with_cache: bool = True,
               sharding: Any = None) -> DecodeState:
    """An empty state (every slot free). `sharding`: optional pytree-prefix of shardings (e.g. from
    `state_shardings`) to place the state on an instance's devices; default: the default device."""
    if num_slots < 1 or length < 1:
        raise ValueError(f"num_slots and length must be positive, got {num_slots}, {length}")
    if length > cfg.max_len:
        raise ValueError(f"canvas length {length} exceeds the model's max_len {cfg.max_len}")
    dtype = _kv_dtype(cfg)
    kv_shape = (num_slots, length, cfg.n_kv_heads, cfg.head_dim)
    kv = tuple(LayerKV(np.zeros(kv_shape, dtype), np.zeros(kv_shape, dtype)) for _ in range(cfg.n_layers)) \
        if with_cache else ()
    zeros_i = np.zeros((num_slots,), np.int32)
    host = DecodeState(
        canvas=np.full((num_slots, length), cfg.pad_id, np.int32), kv=kv, prompt_len=zeros_i,
        answer_len=zeros_i, block_start=zeros_i, block_len=zeros_i,
        temperature=np.zeros((num_slots,), np.float32),
        seed=np.zeros((num_slots,), np.uint32), steps=zeros_i)
    if sharding is None:
        return jax.device_put(host)
    return jax.device_put(host, sharding)


def state_shardings(state_like: DecodeState, kv_sharding: Any, other_sharding: Any) -> DecodeState:
    """A DecodeState-shaped pytree of shardings: `kv_sharding` for every K/V leaf (e.g. a
    NamedSharding splitting axis 2, the kv heads), `other_sharding` (e.g. replicated) elsewhere."""
    return jax.tree.map(lambda _: other_sharding, state_like).replace(
        kv=jax.tree.map(lambda _: kv_sharding, state_like.kv))
