"""Dual and prefix caches equal a plain cached sampler token for token.

The plain sampler states what the caches mean: each block starts with a full forward (the
refresh), whose K/V become the cache; every later step of the block recomputes the block (dual) or
the block and everything after it (prefix) against that cache, and nothing it computes is kept.
The slot decoder must give the same commits step by step, alone and batched.
"""
import jax.numpy as jnp
import numpy as np
import pytest

from dilaserve_jax.decoding.reference import commit_mask, is_finished, propose
from dilaserve_jax.models.llada import forward
from fastdecode_support import prompts, run_to_end

GEN, BLOCK = 40, 16


def plain_cached(graphdef, params, cfg, prompt, gen, block, tau, mode):
    """Greedy threshold decoding with a block-wise cache refreshed once per block.
    Returns (final canvas, commits per step, number of reuse steps)."""
    p, total = len(prompt), len(prompt) + gen
    canvas = np.array(list(prompt) + [cfg.mask_id] * gen, np.int32)
    committed, reuses = [], 0
    for lo in range(p, total, block):
        hi = min(lo + block, total)
        cache = None
        while np.any(canvas[lo:hi] == cfg.mask_id) and not is_finished(canvas, p, cfg.mask_id, cfg.eos_id):
            if cache is None:  # refresh: every position, its K/V kept for the rest of the block
                logits, cache = forward(graphdef, params, jnp.asarray(canvas)[None], jnp.arange(total)[None])
                rows = np.asarray(logits[0])[lo:hi]
            else:
                reuses += 1
                q_end = hi if mode == "dual" else total
                q = jnp.arange(lo, q_end)[None]
                logits, _ = forward(graphdef, params, jnp.asarray(canvas[lo:q_end])[None], q, cache)
                rows = np.asarray(logits[0])[:hi - lo]
            proposals, confidence = propose(rows, cfg.mask_id, 0.0, None)
            commit = commit_mask(canvas[lo:hi] == cfg.mask_id, confidence, tau)
            canvas[lo:hi] = np.where(commit, proposals, canvas[lo:hi])
            committed.append(int(commit.sum()))
        if is_finished(canvas, p, cfg.mask_id, cfg.eos_id):
            break
    return canvas, committed, reuses


@pytest.mark.parametrize("mode", ["dual", "prefix"])
@pytest.mark.parametrize("tau", [1.0, 0.6])
def test_cache_modes_equal_the_plain_cached_sampler(make_decoder, sharp_model, mode, tau):
    cfg, graphdef, params = sharp_model
    ps = prompts(3, seed=17)
    dec = make_decoder(mode)
    for slot, prompt in enumerate(ps):
        dec.admit(slot, prompt, GEN, BLOCK)
    per_step = run_to_end(dec, {slot: tau for slot in range(len(ps))})
    reuse_steps = 0
    for slot, prompt in enumerate(ps):
        canvas, committed, reuses = plain_cached(graphdef, params, cfg, prompt, GEN, BLOCK, tau, mode)
        assert per_step[slot] == committed
        assert dec.canvas(slot) == canvas.tolist()
        reuse_steps += reuses
    assert reuse_steps > 0  # the reuse path really ran
