"""The commit rule in JAX: proposals, confidences, which positions to commit, when a request ends.

Same semantics as decoding/reference.py (propose, commit_mask, is_finished), batched over slots
with per-slot τ, temperature and sampling key as array inputs (changing them never recompiles).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

# Bins of the per-step confidence histogram (uniform over [0, 1]); the threshold controller reads
# a request's first-step histogram as evidence of how risky a lower τ is for it.
CONFIDENCE_BINS = 20  # edges on every multiple of 0.05, so the τ grid's points fall on them


def propose(logits, mask_id: int, temperature, keys):
    """Proposal and its confidence at every position: logits [B, N, V] -> (tokens [B, N], conf [B, N]).

    The mask token is never proposed. temperature [B]: 0 = greedy argmax, > 0 = Gumbel-max sampling
    from logits / temperature with the slot's key [B]. Confidence is the plain softmax probability
    of the proposal.
    """
    logits = logits.astype(jnp.float32).at[..., mask_id].set(-jnp.inf)
    top = jnp.max(logits, axis=-1, keepdims=True)
    shifted = logits - top
    denom = jnp.sum(jnp.exp(shifted), axis=-1)
    greedy = jnp.argmax(logits, axis=-1)

    def sample(key, row_logits, temp):
        gumbel = jax.random.gumbel(key, row_logits.shape, jnp.float32)
        return jnp.argmax(row_logits / temp + gumbel, axis=-1)

    sampling = temperature > 0

    def with_sampling():
        safe_temp = jnp.where(sampling, temperature, 1.0)
        sampled = jax.vmap(sample)(keys, logits, safe_temp)
        return jnp.where(sampling[:, None], sampled, greedy)

    # Gumbel noise for every row and vocabulary entry (threefry bits, two logs) was a measurable
    # share of a greedy step (docs/decode_throughput.md), so an all-greedy batch skips drawing it; a
    # sampling row draws the same noise whatever shares its batch.
    tokens = jax.lax.cond(jnp.any(sampling), with_sampling, lambda: greedy)
    picked = jnp.take_along_axis(shifted, tokens[..., None], axis=-1)[..., 0]
    return tokens.astype(jnp.int32), jnp.exp(picked) / denom


def select_commits(masked, confidence, tau):
    """masked [B, N] bool (masked and inside the current block), confidence [B, N], tau [B]
    -> commit [B, N] bool: masked with confidence > τ strictly, plus the most confident masked
    position (ties to the lowest index); nothing when no position is masked."""
    conf = jnp.where(masked, confidence, -jnp.inf)
    best = jnp.argmax(conf, axis=-1)
    is_best = jnp.arange(conf.shape[-1])[None, :] == best[:, None]
    return masked & ((conf > tau[:, None]) | is_best)


def request_finished(canvas, prompt_len, answer_len, mask_id: int, eos_id: int):
    """canvas [B, L] -> [B] bool: every answer position before the first committed EOS is committed."""
    pos = jnp.arange(canvas.shape[1])[None, :]
    answer_end = (prompt_len + answer_len)[:, None]
    in_answer = (pos >= prompt_len[:, None]) & (pos < answer_end)
    first_eos = jnp.min(jnp.where(in_answer & (canvas == eos_id), pos, answer_end), axis=1)
    pending = in_answer & (pos < first_eos[:, None]) & (canvas == mask_id)
    return ~jnp.any(pending, axis=1)


def compact_commits(commit, positions, tokens):
    """Move committed (position, token) pairs to the front, in position order: -> (positions [B, N],
    tokens [B, N], count [B]); entries past count are -1."""
    order = jnp.argsort(~commit, axis=-1, stable=True)
    taken = jnp.take_along_axis(commit, order, axis=-1)
    pos = jnp.where(taken, jnp.take_along_axis(positions, order, axis=-1), -1)
    tok = jnp.where(taken, jnp.take_along_axis(tokens, order, axis=-1), -1)
    return pos.astype(jnp.int32), tok.astype(jnp.int32), jnp.sum(commit, axis=-1).astype(jnp.int32)


def confidence_histogram(masked, confidence, bins: int = CONFIDENCE_BINS):
    """masked [B, N] bool, confidence [B, N] -> [B, bins] int32: masked positions per confidence bin
    (bin i holds [i / bins, (i + 1) / bins); a confidence of exactly 1.0 falls in the last bin)."""
    index = jnp.clip((confidence * bins).astype(jnp.int32), 0, bins - 1)
    one_hot = masked[..., None] & (index[..., None] == jnp.arange(bins)[None, None, :])
    return jnp.sum(one_hot, axis=1).astype(jnp.int32)
