"""Query rows -> logits -> proposals: the one place a step turns the forward's hidden rows into
proposed tokens and their confidences for the commit window.

Which hidden row scores which canvas position is decided here only (`window_rows`): today row
i scores position i. A model family that scores a position with another row's logits (shifted
logits: position i from row i - 1) changes this mapping and nothing else in the step.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dilaserve_jax.decoding.commit import propose
from dilaserve_jax.models.llada import forward_logits


def window_rows(window, query_start, n_queries: int):
    """Query-row index of each commit-window position: window [B, N] absolute positions, the
    queries being the contiguous positions query_start [B] + [0, n_queries). Clamped into range
    (window positions past the canvas belong to no query; the commit rule ignores them)."""
    return jnp.clip(window - query_start[:, None], 0, n_queries - 1)


def block_proposals(graphdef, params, hidden, window, query_start, *, mask_id: int, temperature, keys):
    """hidden [B, Q, d_model] (the queries' last-block output) -> (tokens [B, N], confidence [B, N])
    at the commit window [B, N]; temperature [B] and keys [B] as in `commit.propose`."""
    with jax.named_scope("lm_head"):
        rows = window_rows(window, query_start, hidden.shape[1])
        logits = forward_logits(graphdef, params, jnp.take_along_axis(hidden, rows[:, :, None], axis=1))
    with jax.named_scope("proposal"):
        return propose(logits, mask_id, temperature, keys)
