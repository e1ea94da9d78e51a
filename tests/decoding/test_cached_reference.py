"""Dual and prefix caches equal a plain cached sampler token for token.

The plain sampler states what the caches mean: each block starts with a full forward (the
refresh), whose K/V become the cache; every later step of the block recomputes the block (dual) or
the block and everything after it (prefix) against that cache, and nothing it computes is kept.
The slot decoder must give the same commits step by step, alone and batched.
"""
import pytest

from fastdecode_support import plain_cached, prompts, run_to_end

GEN, BLOCK = 40, 16


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
