"""Small random Dream-format checkpoints for the tests (written through models.hf.save_hf_checkpoint)."""
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from dilaserve_jax.models import ModelConfig, init_model
from dilaserve_jax.models.hf import save_hf_checkpoint

BIAS_SCALE = 0.1  # larger biases swamp the positional signal: every masked position proposes one token


def random_dream_params(cfg: ModelConfig, seed: int = 0, head_scale: float = 1.0):
    """(graphdef, params) of cfg with every parameter random: init_model leaves biases at zero and
    norm weights at one, which would let bias and norm-order mistakes pass unseen. head_scale
    sharpens the LM head so that thresholds below 1 commit several tokens per step."""
    model = init_model(cfg, seed=seed)
    key = jax.random.PRNGKey(seed + 1000)
    for i, block in enumerate(model.blocks):
        for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
            bias = getattr(block, name).bias
            bias[...] = BIAS_SCALE * jax.random.normal(jax.random.fold_in(key, 10 * i + j), bias[...].shape, bias[...].dtype)
        for j, norm in enumerate((block.attn_norm, block.ff_norm)):
            noise = jax.random.normal(jax.random.fold_in(key, 10 * i + 5 + j), norm.weight[...].shape)
            norm.weight[...] = (1.0 + 0.3 * noise).astype(norm.weight[...].dtype)
    model.ln_f.weight[...] = 1.0 + 0.3 * jax.random.normal(jax.random.fold_in(key, 9999), model.ln_f.weight[...].shape)
    model.lm_head.kernel[...] = model.lm_head.kernel[...] * jnp.float32(head_scale)
    return nnx.split(model)


def write_dream_checkpoint(path: Path, cfg: ModelConfig, seed: int = 0, head_scale: float = 1.0,
                           max_shard_bytes: int | None = 60_000) -> Path:
    """A sharded (with index) Dream-format checkpoint of random weights at `path`."""
    _, params = random_dream_params(cfg, seed, head_scale)
    save_hf_checkpoint(path, cfg, params, max_shard_bytes=max_shard_bytes)
    return path
