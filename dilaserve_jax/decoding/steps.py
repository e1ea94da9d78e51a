"""The pure step functions: one denoising step over a gathered batch of slots, and admission.

`decode_step(graphdef, params, state, slots, taus, shape=..., cfg=...)` gathers the slots' rows,
runs one model forward (full canvas, or the current block / block + suffix against the cache),
commits by the threshold rule, and scatters canvas, K/V and block progress back.

Padding: batch rows beyond the real slots carry slot index S (one past the last slot). Reads clamp
it to a real slot (its results are computed and discarded) and every write uses mode="drop", so a
padded row can never change the state. Padded query rows use position `shape.length`, which the
model (and `write_kv`) drop from cache writes.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dilaserve_jax.decoding.buckets import StepShape, StepType
from dilaserve_jax.decoding.commit import (compact_commits, confidence_histogram, propose, request_finished,
                                           select_commits)
from dilaserve_jax.decoding.shift import logit_rows, reuse_query_start
from dilaserve_jax.decoding.state import DecodeState
from dilaserve_jax.models.config import ModelConfig
from dilaserve_jax.models.llada import LayerKV, forward, write_kv


class StepOutput(NamedTuple):
    """Per batch row (small; copied to the host after every step)."""

    positions: jax.Array  # [B, block] int32 absolute positions committed, position order, -1 padded
    tokens: jax.Array  # [B, block] int32 tokens committed, -1 padded
    n_committed: jax.Array  # [B] int32
    max_confidence: jax.Array  # [B] float32 highest confidence among the block's masked positions
    block_finished: jax.Array  # [B] bool: the block has no mask left (block_start has advanced)
    request_finished: jax.Array  # [B] bool
    confidence_counts: jax.Array  # [B, CONFIDENCE_BINS] int32 the block's masked positions per confidence bin


def _take_rows(x, slots):
    return jnp.take(x, slots, axis=0, mode="clip")


def _write_rows(buf, slots, fresh):
    """Write fresh [B, length, ...] over rows `slots` of buf [S, L, ...] from position 0.

    Whole-row scatters (one index per slot) are several times faster on CPU than per-position
    ones, so a shorter length bucket is completed with the rows' own tail first.
    """
    fresh = fresh.astype(buf.dtype)
    if fresh.shape[1] < buf.shape[1]:
        fresh = jnp.concatenate([fresh, _take_rows(buf, slots)[:, fresh.shape[1]:]], axis=1)
    return buf.at[slots].set(fresh, mode="drop")


def _sampling_keys(seed, steps):
    return jax.vmap(lambda s, n: jax.random.fold_in(jax.random.PRNGKey(s), n))(seed, steps)


def decode_step(graphdef, params, state: DecodeState, slots, taus, *, shape: StepShape,
                cfg: ModelConfig) -> tuple[DecodeState, StepOutput]:
    """One step of `shape.step` over slots [B] (padding rows = state.num_slots) with thresholds taus [B]."""
    length, block, n_q = shape.length, shape.block, shape.queries
    canvas = _take_rows(state.canvas, slots)[:, :length]  # [B, length]
    prompt_len, answer_len = _take_rows(state.prompt_len, slots), _take_rows(state.answer_len, slots)
    block_start, block_len = _take_rows(state.block_start, slots), _take_rows(state.block_len, slots)
    valid_len = prompt_len + answer_len
    block_end = jnp.minimum(block_start + block_len, valid_len)
    window = block_start[:, None] + jnp.arange(block)[None, :]  # [B, block] commit window
    in_block = window < block_end[:, None]

    shift = cfg.logits_shift
    if shape.step in (StepType.FULL, StepType.REFRESH):
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (canvas.shape[0], length))
        rows = logit_rows(window, jnp.zeros_like(block_start), shift)
        logits, fresh_kv = forward(graphdef, params, canvas, positions, None, valid_len,
                                   logits_at=jnp.minimum(rows, length - 1))
    else:
        query_end = block_end if shape.step is StepType.DUAL else valid_len
        q_start = reuse_query_start(block_start, shift)
        q_pos = q_start[:, None] + jnp.arange(n_q)[None, :]
        positions = jnp.where(q_pos < query_end[:, None], q_pos, length).astype(jnp.int32)
        q_tokens = jnp.take_along_axis(canvas, jnp.minimum(positions, length - 1), axis=1)
        cache = [LayerKV(_take_rows(kv.k, slots)[:, :length], _take_rows(kv.v, slots)[:, :length])
                 for kv in state.kv]
        rows = logit_rows(window, q_start, shift)
        logits_at = None if n_q == block and shift == 0 else jnp.minimum(rows, n_q - 1)
        logits, fresh_kv = forward(graphdef, params, q_tokens, positions, cache, valid_len, logits_at=logits_at)

    block_tokens = jnp.take_along_axis(canvas, jnp.minimum(window, length - 1), axis=1)
    masked = in_block & (block_tokens == cfg.mask_id)
    keys = _sampling_keys(_take_rows(state.seed, slots), _take_rows(state.steps, slots))
    temperature = _take_rows(state.temperature, slots)
    proposals, confidence = propose(logits, cfg.mask_id, temperature, keys)
    commit = select_commits(masked, confidence, taus)
    new_block_tokens = jnp.where(commit, proposals, block_tokens)

    rows = jnp.arange(canvas.shape[0])[:, None]
    canvas = canvas.at[rows, jnp.where(in_block, window, length)].set(new_block_tokens, mode="drop")
    block_done = ~jnp.any(in_block & (new_block_tokens == cfg.mask_id), axis=1)
    finished = request_finished(canvas, prompt_len, answer_len, cfg.mask_id, cfg.eos_id)
    max_conf = jnp.max(jnp.where(masked, confidence, -jnp.inf), axis=1)
    out_pos, out_tok, n_committed = compact_commits(commit, window, proposals)

    # Write back whole rows (one index per slot): per-position scatters into the donated state make
    # XLA CPU copy the whole buffer; row scatters update it in place. Padded rows (slot == S) drop.
    new_canvas = _write_rows(state.canvas, slots, canvas)
    new_kv = state.kv
    if shape.step is StepType.REFRESH:
        new_kv = tuple(LayerKV(_write_rows(old.k, slots, fresh.k), _write_rows(old.v, slots, fresh.v))
                       for old, fresh in zip(state.kv, fresh_kv))
    elif shape.step is not StepType.FULL:
        new_kv = tuple(LayerKV(_write_rows(old.k, slots, write_kv(cached.k, fresh.k, positions)),
                               _write_rows(old.v, slots, write_kv(cached.v, fresh.v, positions)))
                       for old, cached, fresh in zip(state.kv, cache, fresh_kv))
    next_block = jnp.where(block_done, block_start + block_len, block_start)
    new_state = state.replace(
        canvas=new_canvas, kv=new_kv,
        block_start=state.block_start.at[slots].set(next_block, mode="drop"),
        tau=state.tau.at[slots].set(taus.astype(jnp.float32), mode="drop"),
        steps=state.steps.at[slots].add(1, mode="drop"))
    return new_state, StepOutput(out_pos, out_tok, n_committed, max_conf, block_done, finished,
                                 confidence_histogram(masked, confidence))


def admit_slot(state: DecodeState, slot, row, prompt_len, answer_len, block_start, block_len, temperature, seed,
               steps) -> DecodeState:
    """Place a canvas row [L] (prompt, answer area, padding) in `slot`; its next step must refresh.
    A fresh request has an all-mask answer area, block_start = prompt_len and steps = 0; one that
    resumes here (migration, failure) brings its committed tokens, current block and step count."""
    return state.replace(
        canvas=state.canvas.at[slot].set(row),
        prompt_len=state.prompt_len.at[slot].set(prompt_len),
        answer_len=state.answer_len.at[slot].set(answer_len),
        block_start=state.block_start.at[slot].set(block_start),
        block_len=state.block_len.at[slot].set(block_len),
        temperature=state.temperature.at[slot].set(temperature),
        seed=state.seed.at[slot].set(seed),
        steps=state.steps.at[slot].set(steps))
