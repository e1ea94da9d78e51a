"""The pure step functions: one denoising step over a gathered batch of slots, and admission.

`decode_step(graphdef, params, state, slots, taus, block_starts, shape=..., cfg=...)` gathers the slots' rows,
runs one model forward (full canvas, or the current block / block + suffix against the cache),
turns the commit window's hidden rows into proposals (decoding/proposal.py), commits by the
threshold rule, and writes back what the step changed.

Which rows a step reads. A step over fewer rows than the state has slots, or over a shorter
canvas, gathers its slots' rows (canvas, scalars and, for a reuse step, K/V) out of the
slot-major state. A step whose batch bucket is every slot and whose canvas is the state's whole
length runs on the state where it lies: batch row r is slot r, and `slots[r]` is r for a slot in
the step and S for one that is not. That gather would copy the whole K/V cache every reuse step,
which at large batch no longer fits the CPU caches and cost a fifth of the step (docs/decode_throughput.md).

What a step writes into the (donated) state, so that its cost follows the work and not the canvas:
- every step: the commit window of each stepped slot's canvas row, and its block start, τ and
  step count;
- a refresh: the K/V of positions [0, length bucket) of each stepped slot (it computed all of them);
- a reuse step recomputes every position whose cached K/V is stale (the block, with shifted logits
  also the row before it; in prefix mode also everything after it) and attends to those fresh
  values. Nothing it computes is ever read later: the slot's next step is another reuse, which
  recomputes the same positions, or a refresh. So a gathered reuse step writes no K/V, and a
  whole-state one leaves its fresh K/V where the model wrote them, in place, for every row —
  stepped or not (a row not stepped recomputes its own positions from its own canvas: the same
  harmless write). Outside those positions the cache always holds the last refresh's K/V. A slot
  whose cache is not its own (just admitted or resumed, its block just finished, weights
  reloaded) must refresh before it reuses (SlotDecoder.step enforces it).

Padding: batch rows beyond the real slots (and, on the whole state, rows of slots not stepped)
carry slot index S (one past the last slot). Gathered reads clamp it to a real slot (its results
are computed and discarded) and every write but the in-place reuse K/V uses mode="drop", so such a
row never changes the canvas, scalars or refresh K/V. Padded query rows use position
`shape.length`, which the model drops from its cache overlay.

Every stage runs under a jax.named_scope (state_gather, layers, lm_head, proposal, commit,
state_write) so profiles of the compiled step can be split by stage (bench/step_profile.py).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dilaserve_jax.decoding.buckets import StepShape, StepType
from dilaserve_jax.decoding.commit import compact_commits, confidence_histogram, request_finished, select_commits
from dilaserve_jax.decoding.proposal import block_proposals
from dilaserve_jax.decoding.shift import reuse_query_start
from dilaserve_jax.decoding.state import DecodeState
from dilaserve_jax.models.config import ModelConfig
from dilaserve_jax.models.llada import LayerKV, forward_hidden

STAGES = ("state_gather", "layers", "lm_head", "proposal", "commit", "state_write")


class StepOutput(NamedTuple):
    """Per batch row (small; copied to the host after every step)."""

    positions: jax.Array  # [B, block] int32 absolute positions committed, position order, -1 padded
    tokens: jax.Array  # [B, block] int32 tokens committed, -1 padded
    n_committed: jax.Array  # [B] int32
    max_confidence: jax.Array  # [B] float32 highest confidence among the block's masked positions
    block_finished: jax.Array  # [B] bool: the block has no mask left (block_start has advanced)
    request_finished: jax.Array  # [B] bool
    confidence_counts: jax.Array  # [B, CONFIDENCE_BINS] int32 the block's masked positions per confidence bin


def runs_in_place(shape: StepShape, num_slots: int, state_length: int) -> bool:
    """Whether a step of `shape` runs on the state where it lies (batch row r = slot r) instead of
    on its slots' gathered rows: when its batch is every slot and its canvas the whole length."""
    return shape.batch == num_slots and shape.length == state_length


def _take_rows(x, slots):
    return jnp.take(x, slots, axis=0, mode="clip")


def _sampling_keys(seed, steps):
    return jax.vmap(lambda s, n: jax.random.fold_in(jax.random.PRNGKey(s), n))(seed, steps)


def decode_step(graphdef, params, state: DecodeState, slots, taus, block_starts, *, shape: StepShape,
                cfg: ModelConfig) -> tuple[DecodeState, StepOutput]:
    """One step of `shape.step` over slots [B] (padding rows = state.num_slots) with thresholds taus [B].

    block_starts [B]: each row's current block (absolute position), as the caller's plan says; -1
    keeps the slot's stored one (padding rows, and rows not stepped in a step on the whole state)."""
    length, block, n_q = shape.length, shape.block, shape.queries
    full_canvas = shape.step in (StepType.FULL, StepType.REFRESH)
    whole = runs_in_place(shape, state.num_slots, state.length)
    with jax.named_scope("state_gather"):
        def read(x):  # the batch's rows of a slot-major array
            return x if whole else _take_rows(x, slots)

        canvas = read(state.canvas)[:, :length]  # [B, length]
        prompt_len, answer_len = read(state.prompt_len), read(state.answer_len)
        block_start = jnp.where(block_starts >= 0, block_starts, read(state.block_start))
        block_len = read(state.block_len)
        temperature = read(state.temperature)
        keys = _sampling_keys(read(state.seed), read(state.steps))
        cache = None if full_canvas else [LayerKV(read(kv.k)[:, :length], read(kv.v)[:, :length]) for kv in state.kv]
    valid_len = prompt_len + answer_len
    block_end = jnp.minimum(block_start + block_len, valid_len)
    window = block_start[:, None] + jnp.arange(block)[None, :]  # [B, block] commit window
    in_block = window < block_end[:, None]

    shift = cfg.logits_shift
    with jax.named_scope("layers"):
        if full_canvas:
            query_start = jnp.zeros_like(block_start)
            positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), canvas.shape)
            hidden, fresh_kv = forward_hidden(graphdef, params, canvas, positions, None, valid_len)
        else:
            # Shifted logits: the queries start at the row before the block, which scores its
            # first position; that row is recomputed against the cache like the block's own.
            query_start = reuse_query_start(block_start, shift)
            query_end = block_end if shape.step is StepType.DUAL else valid_len
            q_pos = query_start[:, None] + jnp.arange(n_q)[None, :]
            positions = jnp.where(q_pos < query_end[:, None], q_pos, length).astype(jnp.int32)
            q_tokens = jnp.take_along_axis(canvas, jnp.minimum(positions, length - 1), axis=1)
            hidden, attended_kv = forward_hidden(graphdef, params, q_tokens, positions, cache, valid_len)
    proposals, confidence = block_proposals(graphdef, params, hidden, window, query_start, shift=shift,
                                            mask_id=cfg.mask_id, temperature=temperature, keys=keys)

    with jax.named_scope("commit"):
        block_tokens = jnp.take_along_axis(canvas, jnp.minimum(window, length - 1), axis=1)
        masked = in_block & (block_tokens == cfg.mask_id)
        commit = select_commits(masked, confidence, taus)
        new_block_tokens = jnp.where(commit, proposals, block_tokens)
        rows = jnp.arange(canvas.shape[0])[:, None]
        write_at = jnp.where(in_block, window, length)  # positions past the block (or canvas) drop
        canvas = canvas.at[rows, write_at].set(new_block_tokens, mode="drop")
        block_done = ~jnp.any(in_block & (new_block_tokens == cfg.mask_id), axis=1)
        finished = request_finished(canvas, prompt_len, answer_len, cfg.mask_id, cfg.eos_id)
        max_conf = jnp.max(jnp.where(masked, confidence, -jnp.inf), axis=1)
        out_pos, out_tok, n_committed = compact_commits(commit, window, proposals)
        next_block = jnp.where(block_done, block_start + block_len, block_start)
        histogram = confidence_histogram(masked, confidence)

    with jax.named_scope("state_write"):
        # Only the window of each canvas row. A slot index S (padding) and a position outside the
        # block (sent past the state's canvas, which may be longer than this bucket) are dropped.
        state_at = jnp.where(in_block, window, state.canvas.shape[1])
        new_canvas = state.canvas.at[slots[:, None], state_at].set(new_block_tokens, mode="drop")
        new_kv = state.kv
        if whole and not full_canvas:  # the model wrote this step's K/V into the state itself
            new_kv = tuple(attended_kv)
        if shape.step is StepType.REFRESH:  # positions [0, length) of each row, one window per slot
            new_kv = tuple(LayerKV(old.k.at[slots, :length].set(fresh.k.astype(old.k.dtype), mode="drop"),
                                   old.v.at[slots, :length].set(fresh.v.astype(old.v.dtype), mode="drop"))
                           for old, fresh in zip(state.kv, fresh_kv))
        new_state = state.replace(
            canvas=new_canvas, kv=new_kv,
            block_start=state.block_start.at[slots].set(next_block, mode="drop"),
            steps=state.steps.at[slots].add(1, mode="drop"))
    return new_state, StepOutput(out_pos, out_tok, n_committed, max_conf, block_done, finished, histogram)


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
