import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from dilaserve_jax.decoding.reference import generate
from dilaserve_jax.models import (MissingTokenizer, TokenizerMissing, canvas_positions, forward, init_model,
                                  load_model, test)
from dilaserve_jax.models.checkpoint import latest_step, restore_params, save_params
from dilaserve_jax.models.hf import CheckpointError, abstract_params, config_from_hf, load_hf_params, save_hf_checkpoint


def _torch_layout_checkpoint(cfg, rng):
    """Random LLaDA tensors in torch [out, in] layout, keyed by HF name."""
    d, hd = cfg.d_model, cfg.head_dim
    shapes = {"model.transformer.wte.weight": (cfg.vocab_size, d), "model.transformer.ln_f.weight": (d,),
              "model.transformer.ff_out.weight": (cfg.vocab_size, d)}
    for i in range(cfg.n_layers):
        p = f"model.transformer.blocks.{i}."
        shapes.update({p + "attn_norm.weight": (d,), p + "ff_norm.weight": (d,),
                       p + "q_proj.weight": (cfg.n_heads * hd, d), p + "k_proj.weight": (cfg.n_kv_heads * hd, d),
                       p + "v_proj.weight": (cfg.n_kv_heads * hd, d), p + "attn_out.weight": (d, cfg.n_heads * hd),
                       p + "ff_proj.weight": (cfg.mlp_hidden, d), p + "up_proj.weight": (cfg.mlp_hidden, d),
                       p + "ff_out.weight": (d, cfg.mlp_hidden)})
    return {k: (rng.standard_normal(s) * 0.2).astype(np.float32) for k, s in shapes.items()}


def _write(path, cfg, tensors, shards=2):
    path.mkdir(parents=True, exist_ok=True)
    keys = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        part = {k: tensors[k] for k in keys[i::shards]}
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, str(path / name))
        weight_map.update({k: name for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({
        "d_model": cfg.d_model, "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads, "n_layers": cfg.n_layers,
        "mlp_hidden_size": cfg.mlp_hidden, "vocab_size": cfg.vocab_size, "embedding_size": cfg.vocab_size,
        "max_sequence_length": cfg.max_len, "mask_token_id": cfg.mask_id, "eos_token_id": cfg.eos_id,
        "pad_token_id": cfg.pad_id, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_eps}))


def _model_from_arrays(cfg, tensors):
    """Build the model by hand from the same arrays (independent of the loader's name table)."""
    model = init_model(cfg)
    t = lambda k: jnp.asarray(tensors[k])  # noqa: E731
    model.wte[...] = t("model.transformer.wte.weight")
    model.ln_f.weight[...] = t("model.transformer.ln_f.weight")
    model.lm_head.kernel[...] = t("model.transformer.ff_out.weight").T
    for i, block in enumerate(model.blocks):
        p = f"model.transformer.blocks.{i}."
        block.attn_norm.weight[...] = t(p + "attn_norm.weight")
        block.ff_norm.weight[...] = t(p + "ff_norm.weight")
        for name in ("q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out"):
            getattr(block, name).kernel[...] = t(p + name + ".weight").T
    return nnx.split(model)


@pytest.fixture
def checkpoint(tmp_path):
    cfg = test()
    tensors = _torch_layout_checkpoint(cfg, np.random.default_rng(0))
    _write(tmp_path / "ckpt", cfg, tensors)
    return cfg, tensors, tmp_path / "ckpt"


def test_sharded_hf_checkpoint_gives_same_logits(checkpoint):
    cfg, tensors, path = checkpoint
    loaded = config_from_hf(path)
    assert loaded.replace(name=cfg.name) == cfg
    graphdef, params = load_hf_params(path, loaded)
    ref_graphdef, ref_params = _model_from_arrays(cfg, tensors)
    tokens = jnp.asarray(np.random.default_rng(1).integers(3, 127, (2, 10)), jnp.int32)
    pos = canvas_positions(2, 10)
    got, _ = forward(graphdef, params, tokens, pos)
    want, _ = forward(ref_graphdef, ref_params, tokens, pos)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_load_into_bf16(checkpoint):
    cfg, _, path = checkpoint
    _, params = load_hf_params(path, cfg.replace(param_dtype="bfloat16"))
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(params)} == {jnp.dtype(ml_dtypes.bfloat16)}


def test_load_model_reads_hf_directory(checkpoint):
    _, _, path = checkpoint
    loaded = load_model(path)
    assert loaded.source.startswith("hf:") and loaded.config.n_layers == 2


def test_missing_tensor_is_named(checkpoint, tmp_path):
    cfg, tensors, _ = checkpoint
    del tensors["model.transformer.blocks.1.up_proj.weight"]
    _write(tmp_path / "broken", cfg, tensors)
    with pytest.raises(CheckpointError, match=r"blocks\.1\.up_proj\.weight.*\(128, 64\)"):
        load_hf_params(tmp_path / "broken", cfg)


def test_wrong_shape_names_key_and_both_shapes(checkpoint, tmp_path):
    cfg, tensors, _ = checkpoint
    tensors["model.transformer.blocks.0.q_proj.weight"] = np.zeros((32, 64), np.float32)
    _write(tmp_path / "broken", cfg, tensors)
    with pytest.raises(CheckpointError, match=r"blocks\.0\.q_proj\.weight.*\(32, 64\).*\(64, 64\)"):
        load_hf_params(tmp_path / "broken", cfg)


def test_unexpected_tensor_is_named(checkpoint, tmp_path):
    cfg, tensors, _ = checkpoint
    tensors["model.transformer.blocks.0.extra.weight"] = np.zeros((4,), np.float32)
    _write(tmp_path / "broken", cfg, tensors)
    with pytest.raises(CheckpointError, match=r"blocks\.0\.extra\.weight"):
        load_hf_params(tmp_path / "broken", cfg)


def test_orbax_round_trip_is_exact(tmp_path):
    cfg = test()
    _, params = nnx.split(init_model(cfg, seed=5))
    save_params(tmp_path / "orbax", 7, params)
    save_params(tmp_path / "orbax", 9, params)
    assert latest_step(tmp_path / "orbax") == 9
    _, abstract = abstract_params(cfg)
    step, restored = restore_params(tmp_path / "orbax", abstract, step=7)
    assert step == 7
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(restored)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(FileNotFoundError, match="step 3"):
        restore_params(tmp_path / "orbax", abstract, step=3)


def test_checkpoint_without_tokenizer_loads_for_token_ids(tmp_path):
    """A vocabulary that is not the character one and no tokenizer files: the model loads, decodes
    token-id prompts exactly as the weights it was written from, and refuses text naming the files."""
    cfg = test().replace(vocab_size=160)
    graphdef, params = nnx.split(init_model(cfg, seed=3))
    save_hf_checkpoint(tmp_path / "ids", cfg, params)
    loaded = load_model(tmp_path / "ids")
    tok = loaded.tokenizer
    assert isinstance(tok, MissingTokenizer)
    assert (tok.vocab_size, tok.mask_id, tok.eos_id, tok.pad_id) == (160, cfg.mask_id, cfg.eos_id, cfg.pad_id)
    prompt = [40, 41, 150, 12]  # 150: an id only this vocabulary has
    got = generate(loaded.graphdef, loaded.params, loaded.config, prompt, 8, 4, threshold=0.9)
    want = generate(graphdef, params, cfg, prompt, 8, 4, threshold=0.9)
    np.testing.assert_array_equal(got.canvas, want.canvas)
    assert got.steps == want.steps
    with pytest.raises(TokenizerMissing, match=r"has no tokenizer \(tokenizer\.json, or vocab\.json \+ merges\.txt\)"):
        tok.encode("hello")
    assert isinstance(TokenizerMissing("x"), FileNotFoundError)
    assert tok.decode(got.answer) == ""  # no text to give; the answer is its ids
