import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dilaserve_jax.models import LayerKV, canvas_positions, forward, init_model, test
from dilaserve_jax.models.config import ModelConfig, preset
from dilaserve_jax.models.llada import rope


@pytest.fixture(scope="module")
def model():
    cfg = test()
    graphdef, params = nnx.split(init_model(cfg, seed=0))
    return cfg, graphdef, params


def run(model, tokens, positions=None, cache=None, valid_len=None):
    cfg, graphdef, params = model
    tokens = jnp.asarray(tokens, jnp.int32)
    if positions is None:
        positions = canvas_positions(*tokens.shape)
    return forward(graphdef, params, tokens, positions, cache, valid_len)


def test_output_shapes(model):
    cfg = model[0]
    logits, kv = run(model, np.ones((3, 11)))
    assert logits.shape == (3, 11, cfg.vocab_size) and logits.dtype == jnp.float32
    assert len(kv) == cfg.n_layers
    assert kv[0].k.shape == kv[0].v.shape == (3, 11, cfg.n_kv_heads, cfg.head_dim)


def test_bidirectional_later_token_changes_earlier_logits(model):
    a = np.full((1, 10), 65)
    b = a.copy()
    b[0, 9] = 66
    la, _ = run(model, a)
    lb, _ = run(model, b)
    assert not np.allclose(la[0, 0], lb[0, 0], atol=1e-6)


def test_rope_scores_depend_only_on_relative_position():
    key = jax.random.PRNGKey(1)
    q = jax.random.normal(key, (1, 1, 1, 16))
    k = jax.random.normal(jax.random.fold_in(key, 1), (1, 1, 1, 16))

    def score(pq, pk):
        qr = rope(q, jnp.array([[pq]]), 10000.0)
        kr = rope(k, jnp.array([[pk]]), 10000.0)
        return float(jnp.sum(qr * kr))

    assert score(3, 1) == pytest.approx(score(10, 8), abs=1e-5)
    assert score(3, 1) == pytest.approx(score(102, 100), abs=1e-4)
    assert score(3, 1) != pytest.approx(score(3, 2), abs=1e-3)


def test_gqa_equals_multi_head_with_repeated_kv_heads():
    gqa_cfg = test()  # 4 heads, 2 kv heads
    mha_cfg = gqa_cfg.replace(n_kv_heads=gqa_cfg.n_heads)
    gqa = init_model(gqa_cfg, seed=3)
    mha = init_model(mha_cfg, seed=4)
    group = gqa_cfg.n_heads // gqa_cfg.n_kv_heads
    hd = gqa_cfg.head_dim
    for gb, mb in zip(gqa.blocks, mha.blocks):
        for name in ("attn_norm", "ff_norm"):
            getattr(mb, name).weight[...] = getattr(gb, name).weight[...]
        for name in ("q_proj", "attn_out", "ff_proj", "up_proj", "ff_out"):
            getattr(mb, name).kernel[...] = getattr(gb, name).kernel[...]
        for name in ("k_proj", "v_proj"):
            kernel = getattr(gb, name).kernel[...].reshape(gqa_cfg.d_model, gqa_cfg.n_kv_heads, hd)
            getattr(mb, name).kernel[...] = jnp.repeat(kernel, group, axis=1).reshape(gqa_cfg.d_model, -1)
    mha.wte[...] = gqa.wte[...]
    mha.ln_f.weight[...] = gqa.ln_f.weight[...]
    mha.lm_head.kernel[...] = gqa.lm_head.kernel[...]
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 127, (2, 9)), jnp.int32)
    pos = canvas_positions(2, 9)
    lg, _ = gqa(tokens, pos)
    lm, _ = mha(tokens, pos)
    np.testing.assert_allclose(lg, lm, atol=1e-5, rtol=1e-5)


def test_cached_forward_matches_full_forward(model):
    """Queries of one block against a cache of the whole canvas equal the full forward's rows; the
    K/V they attended to are the cache with theirs written in (the whole canvas's, here)."""
    tokens = np.random.default_rng(1).integers(3, 127, (2, 12)).astype(np.int32)
    full_logits, full_kv = run(model, tokens)
    cache = [LayerKV(kv.k, kv.v) for kv in full_kv]
    block = np.arange(4, 8)
    logits, kv = run(model, tokens[:, block], jnp.asarray(np.broadcast_to(block, (2, 4))), cache)
    np.testing.assert_allclose(logits, full_logits[:, block], atol=1e-5, rtol=1e-5)
    assert kv[0].k.shape == full_kv[0].k.shape
    np.testing.assert_allclose(kv[0].k, full_kv[0].k, atol=1e-5)


def test_valid_len_masks_padding(model):
    tokens = np.random.default_rng(2).integers(3, 127, (1, 8)).astype(np.int32)
    padded = np.concatenate([tokens, np.full((1, 5), 7, np.int32)], axis=1)
    short, _ = run(model, tokens)
    long, _ = run(model, padded, valid_len=jnp.array([8]))
    np.testing.assert_allclose(long[:, :8], short, atol=1e-5, rtol=1e-5)


def test_config_validation_names_the_problem():
    with pytest.raises(ValueError, match="n_kv_heads"):
        test().replace(n_kv_heads=3)
    with pytest.raises(ValueError, match="mask_id"):
        test().replace(mask_id=500)
    with pytest.raises(ValueError, match="unknown model preset"):
        preset("gpt5")
    assert isinstance(preset("llada_8b"), ModelConfig)


def test_llada_8b_preset_values():
    cfg = preset("llada_8b")
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_hidden) == (32, 4096, 32, 32, 128, 12288)
    assert (cfg.vocab_size, cfg.mask_id, cfg.eos_id, cfg.max_len, cfg.rope_theta) == (126464, 126336, 126081, 4096, 500000.0)
