"""Query rows -> logits -> proposals: the one place a step turns the forward's hidden rows into
proposed tokens and their confidences for the commit window.

Which hidden row scores which canvas position is decided by decoding/shift.py (`logit_rows`): row
i for LLaDA, row i - 1 for a shifted-logits family (Dream). Only the window's rows reach the LM head.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dilaserve_jax.decoding.commit import propose
from dilaserve_jax.decoding.shift import logit_rows
from dilaserve_jax.models.llada import forward_logits


def window_rows(window, query_start, shift: int, n_queries: int):
    """Query-row index of each commit-window position: window [B, N] absolute positions, the
    queries being the contiguous positions query_start [B] + [0, n_queries). Clamped into range
    (window positions past the canvas belong to no query; the commit rule ignores them)."""
    return jnp.clip(logit_rows(window, query_start, shift), 0, n_queries - 1)


def block_proposals(graphdef, params, hidden, window, query_start, *, shift: int, mask_id: int, temperature,
                    keys):
    """hidden [B, Q, d_model] (the queries' last-block output) -> (tokens [B, N], confidence [B, N])
    at the commit window [B, N]; temperature [B] and keys [B] as in `commit.propose`."""
    with jax.named_scope("lm_head"):
        rows = window_rows(window, query_start, shift, hidden.shape[1])
        logits = forward_logits(graphdef, params, jnp.take_along_axis(hidden, rows[:, :, None], axis=1))
    with jax.named_scope("proposal"):
        return propose(logits, mask_id, temperature, keys)
