"""Plain-XLA bidirectional attention: the reference every kernel is tested against."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def products_precision(dtype) -> lax.Precision | None:
    """Exact float32 products for float32 inputs (GPU XLA would otherwise multiply them in TF32,
    10-bit mantissas); the backend's default for narrower inputs, which it multiplies exactly."""
    return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def reference_attention(q, k, v, valid_len):
    """Bidirectional grouped-query attention with per-row valid key lengths.

    q: [B, Q, H, D]; k, v: [B, L, KVH, D] with H % KVH == 0; valid_len: [B] int.
    Keys at positions >= valid_len[b] are ignored. Scores and softmax run in float32;
    the result has q's dtype. Scale is 1/sqrt(D). Products at `products_precision`, as in the
    Pallas kernel.
    """
    b, nq, h, d = q.shape
    kvh = k.shape[2]
    g = h // kvh
    qg = q.reshape(b, nq, kvh, g, d).astype(jnp.float32)
    precision = products_precision(q.dtype)
    scores = jnp.einsum("bqkgd,blkd->bkgql", qg, k.astype(jnp.float32),
                        precision=precision) / jnp.sqrt(jnp.float32(d))
    key_ok = jnp.arange(k.shape[1])[None, :] < valid_len[:, None]  # [B, L]
    scores = jnp.where(key_ok[:, None, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    # A row with no valid key (unused slot, valid_len 0) gives NaN from softmax; make it zero.
    probs = jnp.where(key_ok[:, None, None, None, :], probs, 0.0)
    out = jnp.einsum("bkgql,blkd->bqkgd", probs, v.astype(jnp.float32), precision=precision)
    return out.reshape(b, nq, h, d).astype(q.dtype)
