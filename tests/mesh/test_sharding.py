"""The sharding table: golden PartitionSpecs per TP degree, and real shards on real (fake) devices."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from dilaserve_jax.mesh import (Layout, kv_cache_partition_spec, kv_cache_sharding, partition_spec, place_params,
                                sharding_table)
from dilaserve_jax.mesh.sharding import rule_for
from dilaserve_jax.models.llada import init_model

C, R, REP = P(None, "model"), P("model", None), P()
BLOCK = ("attn_norm/weight", "q_proj/kernel", "k_proj/kernel", "v_proj/kernel", "attn_out/kernel",
         "ff_norm/weight", "ff_proj/kernel", "up_proj/kernel", "ff_out/kernel")
# 8 heads, 2 kv heads: kv projections are split at TP 2 and replicated (GQA) at TP 4 and 8.
GOLDEN = {
    1: dict(wte=REP, lm_head=REP, ln_f=REP, block=(REP,) * 9),
    2: dict(wte=C, lm_head=C, ln_f=REP, block=(REP, C, C, C, R, REP, C, C, R)),
    4: dict(wte=C, lm_head=C, ln_f=REP, block=(REP, C, REP, REP, R, REP, C, C, R)),
    8: dict(wte=C, lm_head=C, ln_f=REP, block=(REP, C, REP, REP, R, REP, C, C, R)),
}


@pytest.mark.parametrize("tp", sorted(GOLDEN))
def test_golden_partition_specs(model, cfg, tp):
    table = sharding_table(model[1], cfg, tp)
    golden = GOLDEN[tp]
    expected = {"wte": golden["wte"], "lm_head/kernel": golden["lm_head"], "ln_f/weight": golden["ln_f"]}
    for layer in range(cfg.n_layers):
        expected |= {f"blocks/{layer}/{name}": spec for name, spec in zip(BLOCK, golden["block"])}
    assert table == expected


def test_kv_heads_sharded_when_tp_divides_them(cfg):
    wide_kv = cfg.replace(n_kv_heads=8)
    for name in ("k_proj", "v_proj"):
        assert partition_spec(f"blocks/0/{name}/kernel", wide_kv, 8) == C
    assert kv_cache_partition_spec(wide_kv, 8) == P(None, None, "model", None)
    assert kv_cache_partition_spec(cfg, 2) == P(None, None, "model", None)
    assert kv_cache_partition_spec(cfg, 4) == REP  # 2 kv heads < TP 4: replicated
    assert kv_cache_partition_spec(cfg, 1) == REP


def test_odd_vocabulary_falls_back_to_replicated_head(cfg):
    odd = cfg.replace(vocab_size=130)
    assert partition_spec("lm_head/kernel", odd, 4) == REP
    assert partition_spec("wte", odd, 4) == C  # still split on d_model


def test_every_parameter_has_a_rule():
    with pytest.raises(KeyError, match="matches no sharding rule"):
        rule_for("blocks/0/attn_out/bias")  # o_proj has no bias in either family


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_dream_biases_follow_their_projections_columns(cfg, tp):
    """q/k/v biases split exactly where their kernels' columns split (replicated with GQA kv heads < TP)."""
    dream = cfg.replace(qkv_bias=True)
    params = nnx.split(init_model(dream, seed=0))[1]
    table = sharding_table(params, dream, tp)
    for layer in range(dream.n_layers):
        for name in ("q_proj", "k_proj", "v_proj"):
            kernel, bias = table[f"blocks/{layer}/{name}/kernel"], table[f"blocks/{layer}/{name}/bias"]
            assert bias == (P("model") if kernel == C else REP)
    assert table["blocks/0/q_proj/bias"] == (REP if tp == 1 else P("model"))
    if tp == 2:
        instance = Layout.build("1x2", jax.devices()[:2], config=dream).instances[0]
        placed = place_params(params, instance, dream)
        bias = placed["blocks"][0]["q_proj"]["bias"]
        assert [s.data.shape for s in bias.addressable_shards] == [(dream.n_heads * dream.head_dim // 2,)] * 2


def _check_sharded(params, tp, min_size):
    """Every parameter of at least min_size elements is split into tp distinct 1/tp shards."""
    checked = []
    for kp, leaf in jax.tree_util.tree_leaves_with_path(params):
        if leaf.size < min_size:
            continue
        shards = leaf.addressable_shards
        assert len({s.device for s in shards}) == tp
        assert all(math.prod(s.data.shape) * tp == leaf.size for s in shards), (jax.tree_util.keystr(kp), tp)
        assert len({repr(s.index) for s in shards}) == tp  # distinct slices, not copies
        checked.append(jax.tree_util.keystr(kp))
    return checked


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_large_parameters_are_actually_sharded(model, cfg, tp):
    instance = Layout.build(f"1x{tp}", jax.devices()[:tp], config=cfg).instances[0]
    params = place_params(model[1], instance, cfg)
    checked = _check_sharded(params, tp, min_size=4096)  # all but norms and the (GQA-replicated) k/v kernels
    assert len(checked) == 2 + cfg.n_layers * 5
    # With as many kv heads as TP the k/v projections are split too.
    wide_kv = cfg.replace(n_kv_heads=8)
    wide_params = place_params(nnx.split(init_model(wide_kv, 0))[1], instance, wide_kv)
    assert len(_check_sharded(wide_params, tp, min_size=4096)) == 2 + wide_kv.n_layers * 7


@pytest.mark.parametrize("tp, kv_heads_per_device", [(1, 2), (2, 1), (4, 2), (8, 2)])
def test_kv_cache_shards(cfg, tp, kv_heads_per_device):
    instance = Layout.build(f"1x{tp}", jax.devices()[:tp], config=cfg).instances[0]
    cache = jax.device_put(jnp.zeros((3, 16, cfg.n_kv_heads, cfg.head_dim)), kv_cache_sharding(instance, cfg))
    assert {s.data.shape for s in cache.addressable_shards} == {(3, 16, kv_heads_per_device, cfg.head_dim)}
    assert len(cache.addressable_shards) == tp


def test_sharded_values_are_the_original(model, cfg):
    instance = Layout.build("1x8", config=cfg).instances[0]
    params = place_params(model[1], instance, cfg)
    for a, b in zip(jax.tree_util.tree_leaves(model[1]), jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("kv_heads", [1, 2, 8])
def test_attention_specs_follow_the_table(cfg, tp, kv_heads):
    """Attention's per-head layout is the table's: q like q_proj's columns, K/V like k_proj and the cache."""
    from dilaserve_jax.kernels.partition import attention_partition_specs

    gqa = cfg.replace(n_kv_heads=kv_heads)
    heads_spec, kv_spec = attention_partition_specs(gqa.n_heads, gqa.n_kv_heads, tp)
    split = P(None, None, "model", None)
    assert heads_spec == (split if partition_spec("blocks/0/q_proj/kernel", gqa, tp) == C else REP)
    assert kv_spec == kv_cache_partition_spec(gqa, tp)
    assert kv_spec == (split if partition_spec("blocks/0/k_proj/kernel", gqa, tp) == C else REP)
