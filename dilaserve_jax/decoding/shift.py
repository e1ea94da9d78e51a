"""Which query row scores which canvas position: the one place decoding handles shifted logits.

Dream keeps its autoregressive initialisation's convention: the logits at position i score token
i + 1, and its sampler shifts them right by one, position 0 keeping its own (cfg.logits_shift = 1).
LLaDA scores each position from its own row (shift 0). A reuse step (dual or prefix cache) queries
the block; with the shift its queries start one position earlier, so the block's first position is
scored by the row before it, computed fresh against the cache like the block's own rows.
"""
from __future__ import annotations

import jax.numpy as jnp


def reuse_query_start(block_start, shift: int):
    """First query position of a reuse step: the block start, or the position before it when shifted.
    (block_start >= 1 always: the prompt is never empty, so the row before the block exists.)"""
    return block_start - shift


def logit_rows(window, query_start, shift: int):
    """Index into a step's query rows of the logits that score each canvas position of `window` [B, N],
    for queries at query_start [B] + 0, 1, 2, ... (full-canvas steps: query_start 0)."""
    source = jnp.maximum(window - shift, 0)  # position 0 keeps its own logits
    return source - query_start[:, None]


def dual_queries(block: int, length: int, shift: int) -> int:
    """Query rows of a dual-cache reuse step: the block, plus the row before it when shifted."""
    return min(block + shift, length)
