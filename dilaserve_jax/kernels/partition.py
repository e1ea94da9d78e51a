"""Where attention's operands lie on an instance mesh: the contract of the per-shard kernel.

Query heads (and the output) are split over the "model" axis as the q_proj columns that produce
them; K/V follow the k/v_proj columns and the KV cache: split by kv heads, or whole on every device
when there are fewer kv heads than TP (`core.heads.kv_heads_replicated`, the rule the sharding
table uses too). A kernel run per shard with these specs computes only its own heads and needs no
collective.
"""
from __future__ import annotations

from jax.sharding import PartitionSpec as P

from dilaserve_jax.core.heads import head_problems, kv_heads_replicated
from dilaserve_jax.core.layouts import MODEL_AXIS, MeshSpecError

HEADS_SHARDED = P(None, None, MODEL_AXIS, None)  # [B, T, heads, D] by heads
REPLICATED = P()


def attention_partition_specs(n_heads: int, n_kv_heads: int, tp: int) -> tuple[P, P]:
    """(spec of q and the output [B, Q, H, D], spec of k and v [B, L, KVH, D]) inside a TP-`tp` instance."""
    problems = head_problems(n_heads, n_kv_heads, tp)
    if problems:
        raise MeshSpecError(f"attention cannot run at TP {tp}: " + "; ".join(problems))
    if tp == 1:
        return REPLICATED, REPLICATED
    return HEADS_SHARDED, REPLICATED if kv_heads_replicated(n_kv_heads, tp) else HEADS_SHARDED
