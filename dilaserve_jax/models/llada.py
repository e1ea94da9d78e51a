"""Masked-diffusion transformer in pure Flax NNX: LLaDA, and Dream (Qwen2 blocks) by config.

Bidirectional attention, pre-RMSNorm, rotate-half RoPE, SwiGLU MLP, untied LM head, grouped-query
attention. Dream's differences are ModelConfig flags: q/k/v biases (`qkv_bias`) and the Qwen2 norm
order (`norm_weight_after_cast`); its shifted logits are the samplers' business (`logits_shift`),
as in Dream's own code, so the forward pass is the same for both. The forward pass is shaped for cached decoding: it takes query tokens and
their absolute positions, optionally a K/V cache covering the whole canvas, and returns logits for
the queries plus the (post-RoPE) K/V they attended to.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from dilaserve_jax.kernels import attention
from dilaserve_jax.models.config import ModelConfig


def _dtype(name: str):
    return jnp.bfloat16 if name == "bfloat16" else jnp.float32


class LayerKV(NamedTuple):
    """Keys (post-RoPE) and values of one layer: each [B, L, KVH, D]."""

    k: jax.Array
    v: jax.Array


class Dense(nnx.Module):
    """Projection, optionally with a bias; kernel stored [in, out] (the transpose of torch's layout)."""

    def __init__(self, d_in: int, d_out: int, *, param_dtype, rngs: nnx.Rngs, bias: bool = False):
        init = jax.nn.initializers.normal(stddev=d_in**-0.5)
        self.kernel = nnx.Param(init(rngs.params(), (d_in, d_out), param_dtype))
        self.bias = nnx.Param(jnp.zeros((d_out,), param_dtype)) if bias else None

    def __call__(self, x):
        y = x @ self.kernel[...].astype(x.dtype)
        return y if self.bias is None else y + self.bias[...].astype(x.dtype)


class RMSNorm(nnx.Module):
    """x * rsqrt(mean(x^2) + eps) in float32. LLaDA multiplies by the weight in float32 and casts
    once; Qwen2/Dream (weight_after_cast) casts back to the activation dtype first."""

    def __init__(self, dim: int, eps: float, *, param_dtype, weight_after_cast: bool = False):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps
        self.weight_after_cast = weight_after_cast

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        if self.weight_after_cast:
            return self.weight[...].astype(x.dtype) * y.astype(x.dtype)
        return (y * self.weight[...].astype(jnp.float32)).astype(x.dtype)


def rope(x, positions, theta: float):
    """Rotate-half rotary embedding of x [B, Q, heads, D] at absolute positions [B, Q], in float32."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, Q, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (xf * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


def write_kv(cache: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """Scatter new [B, Q, KVH, D] into cache [B, L, KVH, D] at positions [B, Q].

    Positions >= L are padding queries and are dropped, so callers can pad query sets freely.
    """
    rows = jnp.arange(cache.shape[0])[:, None]
    return cache.at[rows, positions].set(new.astype(cache.dtype), mode="drop")


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        pd = _dtype(cfg.param_dtype)
        self.cfg = cfg
        norm = dict(param_dtype=pd, weight_after_cast=cfg.norm_weight_after_cast)
        qkv = dict(param_dtype=pd, rngs=rngs, bias=cfg.qkv_bias)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.rms_eps, **norm)
        self.q_proj = Dense(cfg.d_model, cfg.n_heads * cfg.head_dim, **qkv)
        self.k_proj = Dense(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, **qkv)
        self.v_proj = Dense(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, **qkv)
        self.attn_out = Dense(cfg.n_heads * cfg.head_dim, cfg.d_model, param_dtype=pd, rngs=rngs)
        self.ff_norm = RMSNorm(cfg.d_model, cfg.rms_eps, **norm)
        self.ff_proj = Dense(cfg.d_model, cfg.mlp_hidden, param_dtype=pd, rngs=rngs)  # SiLU gate
        self.up_proj = Dense(cfg.d_model, cfg.mlp_hidden, param_dtype=pd, rngs=rngs)
        self.ff_out = Dense(cfg.mlp_hidden, cfg.d_model, param_dtype=pd, rngs=rngs)  # down projection

    def __call__(self, x, positions, cache: LayerKV | None, valid_len):
        cfg = self.cfg
        b, q_len, _ = x.shape
        h = self.attn_norm(x)
        q = rope(self.q_proj(h).reshape(b, q_len, cfg.n_heads, cfg.head_dim), positions, cfg.rope_theta)
        k = rope(self.k_proj(h).reshape(b, q_len, cfg.n_kv_heads, cfg.head_dim), positions, cfg.rope_theta)
        v = self.v_proj(h).reshape(b, q_len, cfg.n_kv_heads, cfg.head_dim)
        if cache is None:
            keys, values = k, v
        else:
            keys, values = write_kv(cache.k, k, positions), write_kv(cache.v, v, positions)
        attn = attention(q, keys, values, valid_len, impl=cfg.attention)
        x = x + self.attn_out(attn.reshape(b, q_len, cfg.n_heads * cfg.head_dim))
        h = self.ff_norm(x)
        x = x + self.ff_out(jax.nn.silu(self.ff_proj(h)) * self.up_proj(h))
        return x, LayerKV(keys, values)


class LLaDAModel(nnx.Module):
    """Masked-diffusion LM (either family). Parameter names mirror the LLaDA checkpoint; models/hf.py
    maps both families' checkpoint keys onto them."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        pd = _dtype(cfg.param_dtype)
        self.cfg = cfg
        self.wte = nnx.Param(jax.nn.initializers.normal(stddev=1.0)(rngs.params(), (cfg.vocab_size, cfg.d_model), pd))
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.ln_f = RMSNorm(cfg.d_model, cfg.rms_eps, param_dtype=pd, weight_after_cast=cfg.norm_weight_after_cast)
        self.lm_head = Dense(cfg.d_model, cfg.vocab_size, param_dtype=pd, rngs=rngs)

    def __call__(self, tokens, positions, kv_cache: Sequence[LayerKV] | None = None, valid_len=None,
                 logits_at=None):
        """Forward pass for query tokens [B, Q] at absolute positions [B, Q].

        kv_cache: per layer, K/V [B, L, KVH, D] of the whole canvas; the queries' fresh K/V are
        written over it at their positions before attending (padding queries at positions >= L
        are dropped). Without a cache the queries attend to each other only, so they must be the
        whole canvas in position order.
        valid_len: [B] keys at positions >= valid_len are ignored (defaults to all keys).
        logits_at: optional [B, O] query indices whose logits to return (a decoding step only needs
        the current block's; skipping the rest saves the LM head's cost on long canvases).
        Returns (logits [B, Q or O, V] float32, per layer the K/V the queries attended to: without
        a cache their own [B, Q, KVH, D]; with one, the cache with theirs written in [B, L, KVH, D]).
        A caller that donates the cache gets that write in place.
        Logits are unshifted: with cfg.logits_shift the row of position i scores position i + 1
        (see `shift_logits`).
        """
        x, new_kv = self.hidden(tokens, positions, kv_cache, valid_len)
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at[:, :, None], axis=1)
        return self.logits(x), new_kv

    def hidden(self, tokens, positions, kv_cache: Sequence[LayerKV] | None = None, valid_len=None):
        """The transformer blocks only: -> (last block's output [B, Q, d_model], per-layer K/V as in
        `__call__`)."""
        cfg = self.cfg
        b = tokens.shape[0]
        if valid_len is None:
            n_keys = tokens.shape[1] if kv_cache is None else kv_cache[0].k.shape[1]
            valid_len = jnp.full((b,), n_keys, jnp.int32)
        x = self.wte[...][tokens].astype(_dtype(cfg.dtype))
        new_kv = []
        for i, block in enumerate(self.blocks):
            x, kv = block(x, positions, None if kv_cache is None else kv_cache[i], valid_len)
            new_kv.append(kv)
        return x, new_kv

    def logits(self, x):
        """Final norm and LM head of hidden rows [..., d_model] -> float32 logits [..., V]."""
        return self.lm_head(self.ln_f(x)).astype(jnp.float32)


def init_model(cfg: ModelConfig, seed: int = 0) -> LLaDAModel:
    return LLaDAModel(cfg, rngs=nnx.Rngs(seed))


def forward(graphdef, params, tokens, positions, kv_cache=None, valid_len=None, logits_at=None):
    """Pure forward over split (graphdef, params): what jitted serving code calls."""
    model = nnx.merge(graphdef, params)
    return model(tokens, positions, kv_cache, valid_len, logits_at)


def forward_hidden(graphdef, params, tokens, positions, kv_cache=None, valid_len=None):
    """Pure `LLaDAModel.hidden`: the blocks' output rows and the K/V they attended to, without the LM head."""
    return nnx.merge(graphdef, params).hidden(tokens, positions, kv_cache, valid_len)


def forward_logits(graphdef, params, hidden_rows):
    """Pure `LLaDAModel.logits`: logits of the given hidden rows (any leading shape)."""
    return nnx.merge(graphdef, params).logits(hidden_rows)


def shift_logits(logits, shift: int):
    """Dream's sampler convention over a whole canvas [B, L, V]: with shift 1, position 0 keeps its
    own logits and position i > 0 takes position i - 1's; shift 0 returns logits unchanged."""
    if shift == 0:
        return logits
    return jnp.concatenate([logits[:, :1], logits[:, :-1]], axis=1)


def canvas_positions(batch: int, length: int):
    return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
