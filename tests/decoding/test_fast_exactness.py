"""Cache mode none is the reference sampler, token for token; refresh-every-step caches are cache none."""
import numpy as np
import pytest

from dilaserve_jax.core.kinds import StepKind
from dilaserve_jax.decoding.reference import generate
from fastdecode_support import prompts, run_to_end

# (prompt length, answer length): one fills the 64-position canvas bucket exactly, one is padded.
CASES = [(16, 48), (10, 40)]


@pytest.fixture(scope="module")
def requests():
    rng = np.random.default_rng(7)
    return [rng.integers(3, 128, size=p).tolist() for p, _ in CASES]


@pytest.mark.parametrize("tau", [1.0, 0.9, 0.5])
def test_cache_none_matches_reference_token_for_token(make_decoder, sharp_model, requests, tau):
    cfg, graphdef, params = sharp_model
    dec = make_decoder("none")
    for slot, (prompt, (_, gen)) in enumerate(zip(requests, CASES)):
        dec.admit(slot, prompt, gen, 16)
    per_step = run_to_end(dec, {0: tau, 1: tau})
    for slot, (prompt, (_, gen)) in enumerate(zip(requests, CASES)):
        ref = generate(graphdef, params, cfg, prompt, gen, 16, threshold=tau)
        assert dec.answer(slot) == ref.answer
        assert per_step[slot] == ref.committed_per_step
        assert dec.canvas(slot)[len(prompt):][:len(ref.answer)] == ref.answer
    if tau == 1.0:
        assert set(per_step[0]) == {1}
    else:
        assert max(per_step[0]) > 1  # the sharpened model really commits several tokens per step


@pytest.mark.parametrize("mode", ["dual", "prefix"])
@pytest.mark.parametrize("tau", [1.0, 0.5])
def test_cache_with_refresh_every_step_equals_cache_none(make_decoder, mode, tau):
    ps = prompts(2, seed=3)
    want = make_decoder("none")
    got = make_decoder(mode)
    for dec in (want, got):
        for slot, p in enumerate(ps):
            dec.admit(slot, p, 40, 16)
    want_steps = run_to_end(want, {0: tau, 1: tau})
    got_steps = run_to_end(got, {0: tau, 1: tau}, force_refresh=True)
    assert got_steps == want_steps
    for slot in range(2):
        assert got.answer(slot) == want.answer(slot)
        assert got.canvas(slot) == want.canvas(slot)


@pytest.mark.parametrize("mode", ["dual", "prefix"])
def test_cached_decoding_fills_blocks_in_order_and_never_commits_the_mask(make_decoder, sharp_model, mode):
    cfg = sharp_model[0]
    dec = make_decoder(mode)
    p = prompts(1, seed=11)[0]
    dec.admit(0, p, 40, 16)
    block_of_last_commit, refreshes = 0, 0
    while True:
        refresh = dec.needs_refresh(0)
        refreshes += refresh
        out = dec.step(StepKind.REFRESH if refresh else StepKind.REUSE, [0], [0.7])[0]
        assert out.n_committed >= 1 and len(out.positions) == out.n_committed
        assert all(t != cfg.mask_id for t in out.tokens)
        blocks = {pos // 16 for pos in out.positions}
        assert len(blocks) == 1 and min(blocks) >= block_of_last_commit  # one block per step, in order
        block_of_last_commit = blocks.pop()
        if out.request_finished:
            break
    assert refreshes == block_of_last_commit + 1  # exactly one refresh per block started
    answer_area = dec.canvas(0)[len(p):]
    eos = answer_area.index(cfg.eos_id) if cfg.eos_id in answer_area else len(answer_area)
    assert cfg.mask_id not in answer_area[:eos]
