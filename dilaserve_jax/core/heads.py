"""How tensor parallelism splits attention heads, in plain numbers.

The sharding table, the per-shard attention kernel and the memory arithmetic all ask the same two
questions of a head count and a TP degree, so the answers are written once, here.
"""
from __future__ import annotations


def kv_heads_replicated(n_kv_heads: int, tp: int) -> bool:
    """The GQA rule: with fewer kv heads than TP (or at TP 1) the K/V projections, the KV cache and
    attention's K/V are whole on every device of the instance, since a kv head cannot be split."""
    return tp == 1 or n_kv_heads < tp


def head_problems(n_heads: int, n_kv_heads: int, tp: int) -> list[str]:
    """Why TP `tp` cannot split these attention heads (empty when it can).

    Query heads must divide by TP. kv heads are sharded when TP divides them and replicated when
    there are fewer than TP (whatever the ratio, since the whole K/V projection and cache are
    copied); kv heads >= TP that TP does not divide are a problem, since a head would be split.
    """
    problems = []
    if n_heads % tp:
        problems.append(f"TP {tp} does not divide the {n_heads} attention heads")
    if n_kv_heads >= tp and n_kv_heads % tp:
        problems.append(f"TP {tp} does not divide the {n_kv_heads} kv heads (fewer kv heads than TP "
                        "would be replicated, but this count would split a head)")
    if n_heads % n_kv_heads:
        problems.append(f"the {n_heads} attention heads are not a multiple of the {n_kv_heads} kv heads")
    return problems
