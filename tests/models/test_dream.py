"""Dream (Qwen2-based DLM) checkpoints: format, loading errors, and the forward pass against NumPy."""
import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dilaserve_jax.models import canvas_positions, forward, load_model, preset, shift_logits, test_dream
from dilaserve_jax.models.hf import CheckpointError, config_from_hf, load_hf_params
from dilaserve_jax.models.llada import RMSNorm
from tests.dream_support import write_dream_checkpoint


@pytest.fixture(scope="module")
def dream_dir(tmp_path_factory):
    cfg = test_dream()
    return cfg, write_dream_checkpoint(tmp_path_factory.mktemp("dream") / "ckpt", cfg, seed=4)


def _tensors(path):
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {}
    for fname in sorted(set(index.values())):
        tensors |= load_file(str(path / fname))
    return tensors


def _rewrite(src, dst, edit_tensors=None, edit_config=None):
    """Copy a checkpoint into one safetensors file, editing its tensors and config.json on the way."""
    dst.mkdir(parents=True)
    tensors = _tensors(src)
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    raw = json.loads((src / "config.json").read_text())
    if edit_config:
        edit_config(raw)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def numpy_dream_logits(t: dict, raw: dict, tokens: np.ndarray) -> np.ndarray:
    """Qwen2 blocks straight from the HF tensors (torch [out, in] layout), in float64, then Dream's
    sampler shift: position 0 keeps its logits, position i > 0 takes position i - 1's."""
    d, n_h, n_kv = raw["hidden_size"], raw["num_attention_heads"], raw["num_key_value_heads"]
    hd, eps, length = d // n_h, raw["rms_norm_eps"], len(tokens)
    t = {k: v.astype(np.float64) for k, v in t.items()}

    def rms(x, w):
        return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))

    def linear(x, name, bias=False):
        y = x @ t[name + ".weight"].T
        return y + t[name + ".bias"] if bias else y

    inv_freq = 1.0 / raw["rope_theta"] ** (np.arange(0, hd, 2) / hd)
    angles = np.arange(length)[:, None] * inv_freq
    cos, sin = np.cos(np.concatenate([angles] * 2, -1))[:, None], np.sin(np.concatenate([angles] * 2, -1))[:, None]

    def rope(x):
        return x * cos + np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1) * sin

    x = t["model.embed_tokens.weight"][tokens]
    for i in range(raw["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, t[p + "input_layernorm.weight"])
        q = rope(linear(h, p + "self_attn.q_proj", True).reshape(length, n_h, hd))
        k = np.repeat(rope(linear(h, p + "self_attn.k_proj", True).reshape(length, n_kv, hd)), n_h // n_kv, axis=1)
        v = np.repeat(linear(h, p + "self_attn.v_proj", True).reshape(length, n_kv, hd), n_h // n_kv, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)  # bidirectional: no causal mask
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + linear(np.einsum("hqk,khd->qhd", probs, v).reshape(length, d), p + "self_attn.o_proj")
        h = rms(x, t[p + "post_attention_layernorm.weight"])
        gate = linear(h, p + "mlp.gate_proj")
        x = x + linear(gate / (1 + np.exp(-gate)) * linear(h, p + "mlp.up_proj"), p + "mlp.down_proj")
    logits = linear(rms(x, t["model.norm.weight"]), "lm_head")
    return np.concatenate([logits[:1], logits[:-1]])


def test_saved_checkpoint_is_dream_format_and_loads_back(dream_dir):
    cfg, path = dream_dir
    raw = json.loads((path / "config.json").read_text())
    assert raw["model_type"] == "Dream" and raw["architectures"] == ["DreamModel"]
    assert not raw["tie_word_embeddings"] and raw["mask_token_id"] == cfg.mask_id
    assert (path / "model.safetensors.index.json").exists() and len(list(path.glob("*.safetensors"))) > 1
    keys = set(_tensors(path))
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
            "model.layers.1.self_attn.k_proj.bias", "model.layers.0.mlp.down_proj.weight",
            "model.layers.0.post_attention_layernorm.weight"} <= keys
    assert not any("o_proj.bias" in k or "mlp" in k and k.endswith("bias") for k in keys)
    loaded = load_model(path)
    assert loaded.config.replace(name=cfg.name) == cfg and loaded.source.startswith("hf:")


def test_forward_with_shift_matches_numpy_qwen2(dream_dir):
    cfg, path = dream_dir
    loaded = load_model(path)
    tokens = np.random.default_rng(3).integers(3, cfg.vocab_size, (2, 13))
    logits, _ = forward(loaded.graphdef, loaded.params, jnp.asarray(tokens, jnp.int32), canvas_positions(2, 13))
    got = np.asarray(shift_logits(logits, cfg.logits_shift))
    raw, tensors = json.loads((path / "config.json").read_text()), _tensors(path)
    for row in range(2):
        want = numpy_dream_logits(tensors, raw, tokens[row])
        np.testing.assert_allclose(got[row], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[:, 1:], np.asarray(logits)[:, :-1])  # the shift is a pure relabelling


def test_ids_come_from_the_checkpoint(dream_dir, tmp_path):
    _, path = dream_dir

    def edit(raw):
        raw.update(mask_token_id=7, eos_token_id=9, pad_token_id=9, bos_token_id=8)

    cfg = config_from_hf(_rewrite(path, tmp_path / "ids", edit_config=edit))
    assert (cfg.mask_id, cfg.eos_id, cfg.pad_id, cfg.bos_id) == (7, 9, 9, 8)
    with pytest.raises(CheckpointError, match="mask_token_id"):
        config_from_hf(_rewrite(path, tmp_path / "nomask", edit_config=lambda raw: raw.pop("mask_token_id")))


def test_missing_bias_is_named_with_its_shape(dream_dir, tmp_path):
    cfg, path = dream_dir
    broken = _rewrite(path, tmp_path / "b", lambda t: t.pop("model.layers.1.self_attn.v_proj.bias"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.v_proj\.bias.*\(32,\)"):
        load_hf_params(broken, cfg)


def test_misshaped_tensor_names_key_and_both_shapes(dream_dir, tmp_path):
    cfg, path = dream_dir

    def shrink(t):
        t["model.layers.0.self_attn.k_proj.bias"] = np.zeros((16,), np.float32)

    with pytest.raises(CheckpointError, match=r"self_attn\.k_proj\.bias.*\(16,\).*\(32,\)"):
        load_hf_params(_rewrite(path, tmp_path / "s", shrink), cfg)


def test_unexpected_tensor_is_named(dream_dir, tmp_path):
    cfg, path = dream_dir

    def add(t):
        t["model.layers.0.self_attn.o_proj.bias"] = np.zeros((cfg.d_model,), np.float32)

    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.o_proj\.bias"):
        load_hf_params(_rewrite(path, tmp_path / "u", add), cfg)


def test_unknown_family_is_refused(dream_dir, tmp_path):
    _, path = dream_dir

    def edit(raw):
        raw.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])

    with pytest.raises(CheckpointError, match="neither LLaDA nor Dream"):
        load_model(_rewrite(path, tmp_path / "g", edit_config=edit))


def test_tied_head_is_read_from_the_embedding(dream_dir, tmp_path):
    cfg, path = dream_dir
    tied = _rewrite(path, tmp_path / "t", lambda t: t.pop("lm_head.weight"),
                    lambda raw: raw.update(tie_word_embeddings=True))
    loaded = load_model(tied)
    np.testing.assert_array_equal(np.asarray(loaded.params["lm_head"]["kernel"][...]),
                                  _tensors(path)["model.embed_tokens.weight"].T)


def test_norm_multiplies_the_weight_after_the_cast_back_in_bf16():
    """Qwen2 order: bf16(x * rsqrt(mean x^2 + eps)) * w, versus LLaDA's bf16(f32 product)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 64)).astype(ml_dtypes.bfloat16)
    w = (1 + 0.3 * rng.standard_normal(64)).astype(ml_dtypes.bfloat16)
    xf = x.astype(np.float32)
    normed = xf / np.sqrt(np.mean(xf * xf, -1, keepdims=True) + 1e-6)
    qwen2 = (w * normed.astype(ml_dtypes.bfloat16)).astype(np.float32)
    llada = (normed * w.astype(np.float32)).astype(ml_dtypes.bfloat16).astype(np.float32)
    for after_cast, want in ((True, qwen2), (False, llada)):
        norm = RMSNorm(64, 1e-6, param_dtype=jnp.bfloat16, weight_after_cast=after_cast)
        norm.weight[...] = jnp.asarray(w)
        got = np.asarray(norm(jnp.asarray(x)).astype(jnp.float32))
        np.testing.assert_allclose(got, want, rtol=0, atol=0)
    assert not np.array_equal(qwen2, llada)  # the two orders really differ in bf16


def test_dream_7b_preset_matches_the_released_config():
    cfg = preset("dream_7b")
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_hidden) == (28, 3584, 28, 4, 128, 18944)
    assert (cfg.vocab_size, cfg.mask_id, cfg.eos_id, cfg.pad_id, cfg.bos_id) == (152064, 151666, 151643, 151643, 151643)
    assert (cfg.rope_theta, cfg.rms_eps, cfg.qkv_bias, cfg.norm_weight_after_cast, cfg.logits_shift) == (1e6, 1e-6, True, True, 1)
