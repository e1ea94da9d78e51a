"""The one sharding table: parameter path -> PartitionSpec over an instance's "model" axis.

Megatron-style tensor parallelism, one all-reduce after attention and one after the MLP:
- q/k/v kernels [d, heads*hd] split by output columns. Columns are head-major, so this splits by
  heads; attn_out [heads*hd, d] is split by rows to match, and its matmul ends in the all-reduce.
  q/k/v biases [heads*hd] (Dream) are split like their kernels' columns, so each device adds the
  bias slice of its own heads.
- MLP gate/up [d, mlp] split by hidden columns, down (ff_out) [mlp, d] by rows.
- RMSNorm weights are tiny: replicated.
- Embedding wte [V, d] split by d_model columns: the token lookup is then a purely local gather
  on each device (vocab sharding would need a masked lookup plus an all-reduce), and each device
  holds 1/TP of a table that is ~1 GB for LLaDA-8B instead of a full copy.
- LM head [d, V] split by vocab columns: each device computes its slice of the logits with no
  weight traffic; softmax/argmax over the vocabulary only reduce [B, Q]-sized values across devices.
- K/V projections and the KV cache [S, L, KVH, D] split by kv heads; when n_kv_heads < TP (GQA)
  they are replicated on every device of the instance, since a kv head cannot be split.

Embedding and LM head fall back to replicated when TP does not divide their sharded dimension
(odd vocabularies); heads, kv heads >= TP and MLP width must divide (see spec.check_model_tp).
At TP 1 everything is replicated (P()). Attention's own operands follow the same kv-head rule
(`core.heads.kv_heads_replicated`; `kernels.partition.attention_partition_specs`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from dilaserve_jax.core.heads import kv_heads_replicated
from dilaserve_jax.core.layouts import MODEL_AXIS
from dilaserve_jax.kernels.partition import HEADS_SHARDED
from dilaserve_jax.models.config import ModelConfig
from dilaserve_jax.mesh.layout import Instance
from dilaserve_jax.mesh.spec import check_model_tp

COLUMNS = P(None, MODEL_AXIS)
VECTOR = P(MODEL_AXIS)  # a bias, split with its projection's columns
ROWS = P(MODEL_AXIS, None)
REPLICATED = P()


@dataclass(frozen=True, slots=True)
class ShardingRule:
    """Parameters whose path matches `pattern` are split as `spec` along the model dimension `splits`."""

    pattern: str
    spec: P
    splits: str  # "heads", "kv_heads", "mlp", "d_model", "vocab" or "none"

    def __post_init__(self):
        re.compile(self.pattern)
        if self.splits not in ("heads", "kv_heads", "mlp", "d_model", "vocab", "none"):
            raise ValueError(f"unknown split dimension {self.splits!r}")


SHARDING_RULES: tuple[ShardingRule, ...] = (
    ShardingRule(r"^wte$", COLUMNS, "d_model"),
    ShardingRule(r"^blocks/\d+/q_proj/kernel$", COLUMNS, "heads"),
    ShardingRule(r"^blocks/\d+/(k_proj|v_proj)/kernel$", COLUMNS, "kv_heads"),
    ShardingRule(r"^blocks/\d+/q_proj/bias$", VECTOR, "heads"),
    ShardingRule(r"^blocks/\d+/(k_proj|v_proj)/bias$", VECTOR, "kv_heads"),
    ShardingRule(r"^blocks/\d+/attn_out/kernel$", ROWS, "heads"),
    ShardingRule(r"^blocks/\d+/(ff_proj|up_proj)/kernel$", COLUMNS, "mlp"),
    ShardingRule(r"^blocks/\d+/ff_out/kernel$", ROWS, "mlp"),
    ShardingRule(r"^(blocks/\d+/(attn_norm|ff_norm)|ln_f)/weight$", REPLICATED, "none"),
    ShardingRule(r"^lm_head/kernel$", COLUMNS, "vocab"),
)

KV_CACHE_SHARDED = HEADS_SHARDED  # [S, L, KVH, D] by kv heads, as attention reads it


def param_path(keypath) -> str:
    """'blocks/0/q_proj/kernel' from a pytree key path of an nnx State or its pure dict."""
    parts = []
    for key in keypath:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, jax.tree_util.GetAttrKey) and key.name == "value":
            continue  # nnx.Variable wrapper
        else:
            parts.append(str(getattr(key, "name", getattr(key, "key", key))))
    return "/".join(parts)


def rule_for(path: str) -> ShardingRule:
    for rule in SHARDING_RULES:
        if re.match(rule.pattern, path):
            return rule
    raise KeyError(f"parameter {path!r} matches no sharding rule; add one to SHARDING_RULES")


def partition_spec(path: str, cfg: ModelConfig, tp: int) -> P:
    """The PartitionSpec of parameter `path` on a TP-`tp` instance."""
    check_model_tp(cfg, tp)
    rule = rule_for(path)
    if tp == 1 or rule.splits == "none":
        return REPLICATED
    if rule.splits == "kv_heads" and kv_heads_replicated(cfg.n_kv_heads, tp):
        return REPLICATED
    if (rule.splits == "vocab" and cfg.vocab_size % tp) or (rule.splits == "d_model" and cfg.d_model % tp):
        return REPLICATED
    return rule.spec


def kv_cache_partition_spec(cfg: ModelConfig, tp: int) -> P:
    """PartitionSpec of one layer's K or V cache [S, L, KVH, D] on a TP-`tp` instance."""
    check_model_tp(cfg, tp)
    return REPLICATED if kv_heads_replicated(cfg.n_kv_heads, tp) else KV_CACHE_SHARDED


def kv_cache_sharding(instance: Instance, cfg: ModelConfig) -> NamedSharding:
    return instance.sharding(kv_cache_partition_spec(cfg, instance.tp))


def sharding_table(params, cfg: ModelConfig, tp: int) -> dict[str, P]:
    """{parameter path: PartitionSpec} for every leaf of `params` (arrays or ShapeDtypeStructs)."""
    return {param_path(kp): partition_spec(param_path(kp), cfg, tp)
            for kp, _ in jax.tree_util.tree_leaves_with_path(params)}


def param_shardings(params, instance: Instance, cfg: ModelConfig):
    """A tree shaped like `params` (nnx State or pure dict) with each leaf's NamedSharding."""
    return jax.tree_util.tree_map_with_path(
        lambda kp, _leaf: instance.sharding(partition_spec(param_path(kp), cfg, instance.tp)), params)
