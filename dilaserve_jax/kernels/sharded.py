"""The Pallas flash kernel run per shard under `shard_map` over an instance's "model" axis.

A Pallas kernel is an opaque custom call: Mosaic (TPU) refuses to partition it and the GPU
partitioner can only gather q/k/v and run the whole attention on every device. Attention needs no
communication under Megatron tensor parallelism, though: each device holds the query heads its
q_proj columns produced and the kv heads those read (all of them when the table replicates K/V),
so the kernel runs on the local heads and the output stays split by heads for attn_out's row split.

The mesh is the one the inputs are laid out on (JAX records it in every traced value's type), so
nothing names devices here, and the specs are `kernels.partition.attention_partition_specs`, built
on the kv-head rule the sharding table uses.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from dilaserve_jax.core.layouts import MODEL_AXIS
from dilaserve_jax.kernels import flash
from dilaserve_jax.kernels.partition import attention_partition_specs


def inputs_mesh(*arrays):
    """The (abstract) mesh the arrays are laid out on, or None for single-device or unplaced arrays."""
    for x in arrays:
        sharding = getattr(jax.typeof(x), "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if mesh is not None and not mesh.empty:
            return mesh
    return None


def model_axis_size(mesh) -> int:
    """TP degree of an instance mesh (1 without a mesh); rejects meshes with other sharded axes."""
    if mesh is None or MODEL_AXIS not in mesh.axis_names:
        return 1
    others = {name: size for name, size in mesh.shape.items() if name != MODEL_AXIS and size > 1}
    if others:
        raise ValueError(f"Pallas attention runs per shard over an instance mesh whose only axis is "
                         f"{MODEL_AXIS!r}; this mesh also has {others}")
    return mesh.shape[MODEL_AXIS]


def _one_kv_head_per_shard(n_heads: int, kv_heads: int, local_heads: int) -> bool:
    # Shard s holds query heads [s * local_heads, (s + 1) * local_heads) and head h reads kv head
    # h // group: one kv head serves the whole shard when local_heads divides group.
    return (n_heads // kv_heads) % local_heads == 0


def kernel_kv_heads(n_heads: int, kv_heads: int, tp: int, kv_replicated: bool) -> int:
    """kv heads the kernel reads on each device (for reports; `_kv_heads_of_this_shard` picks them)."""
    if tp == 1:
        return kv_heads
    if not kv_replicated:
        return kv_heads // tp
    local_heads = n_heads // tp
    return 1 if _one_kv_head_per_shard(n_heads, kv_heads, local_heads) else local_heads


def _kv_heads_of_this_shard(k, v, n_heads: int, local_heads: int):
    """From replicated K/V [B, L, KVH, D], the kv heads this shard's query heads read.

    When they all read one kv head (KVH divides TP, e.g. every power-of-two kv count) that is a
    [B, L, 1, D] slice and the kernel's group is local_heads. Otherwise (3 kv heads at TP 4) the
    shard straddles kv heads and each local query head gets its own kv head (group 1). Either way
    a local copy of the heads read, at most local_heads * [B, L, D] per layer.
    """
    kv_heads = k.shape[2]
    group = n_heads // kv_heads
    first_head = lax.axis_index(MODEL_AXIS) * local_heads
    if _one_kv_head_per_shard(n_heads, kv_heads, local_heads):
        first_kv = first_head // group
        return (lax.dynamic_slice_in_dim(k, first_kv, 1, axis=2),
                lax.dynamic_slice_in_dim(v, first_kv, 1, axis=2))
    kv_index = (first_head + jnp.arange(local_heads)) // group
    return jnp.take(k, kv_index, axis=2), jnp.take(v, kv_index, axis=2)


def _per_shard(q, k, v, valid_len, *, n_heads: int, kv_replicated: bool, options: dict):
    if kv_replicated:
        k, v = _kv_heads_of_this_shard(k, v, n_heads, q.shape[2])
    return flash.flash_attention(q, k, v, valid_len, **options)


def sharded_flash_attention(q, k, v, valid_len, *, mesh, **kernel_options):
    """`flash.flash_attention` on each device of `mesh` over its own heads; same contract and result.

    q [B, Q, H, D], k/v [B, L, KVH, D] as laid out by the sharding table on the instance mesh
    (any other layout is first moved to it by XLA); valid_len [B] replicated.
    """
    n_heads, kv_heads = q.shape[2], k.shape[2]
    tp = model_axis_size(mesh)
    heads_spec, kv_spec = attention_partition_specs(n_heads, kv_heads, tp)
    body = functools.partial(_per_shard, n_heads=n_heads, kv_replicated=tp > 1 and kv_spec == P(),
                             options=kernel_options)
    # check_vma off: pallas_call has no rule for varying-axis types; the specs above are the contract.
    return jax.shard_map(body, mesh=mesh, in_specs=(heads_spec, kv_spec, kv_spec, P()), out_specs=heads_spec,
                         check_vma=False)(q, k, v, valid_len)


def flash_attention_on_inputs_mesh(q, k, v, valid_len, **kernel_options):
    """The kernel per shard when the inputs lie on a mesh with a "model" axis of size > 1, else
    the plain kernel (one device, or a TP-1 instance). Works traced (inside jit) and eagerly."""
    mesh = inputs_mesh(q, k, v)
    if model_axis_size(mesh) == 1:
        return flash.flash_attention(q, k, v, valid_len, **kernel_options)
    return sharded_flash_attention(q, k, v, valid_len, mesh=mesh, **kernel_options)
