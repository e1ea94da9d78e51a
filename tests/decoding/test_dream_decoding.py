"""Dream's shifted logits in fast decoding: cache none is the reference sampler (which shifts like
Dream's own), refresh-every-step caches are cache none, and reuse steps score a block's first
position with the row before the block."""
import pytest

from dilaserve_jax.core.kinds import StepKind, CacheMode
from dilaserve_jax.decoding.compiled import CompiledSteps
from dilaserve_jax.decoding.decoder import DecoderConfig, SlotDecoder
from dilaserve_jax.decoding.reference import generate
from dilaserve_jax.models import load_model, test_dream
from fastdecode_support import plain_cached, prompts, run_to_end
from tests.dream_support import random_dream_params, write_dream_checkpoint

LENGTH, BLOCK = 64, 16
CASES = [(16, 48), (10, 40)]  # (prompt, answer): one fills the canvas bucket, one is padded


@pytest.fixture(scope="module")
def dream(tmp_path_factory):
    """A random Dream-format checkpoint written by the save path and loaded back (sharpened head)."""
    path = write_dream_checkpoint(tmp_path_factory.mktemp("dream") / "ckpt", test_dream(), seed=1, head_scale=12.0)
    loaded = load_model(path)
    assert loaded.config.logits_shift == 1
    return loaded.config, loaded.graphdef, loaded.params


@pytest.fixture(scope="module")
def make(dream):
    cfg, graphdef, params = dream
    compiled = CompiledSteps(cfg, graphdef)

    def build(mode: str) -> SlotDecoder:
        return SlotDecoder(cfg, graphdef, params, DecoderConfig(2, (LENGTH,), (BLOCK,), CacheMode(mode)),
                           compiled=compiled, warm_up=False, progress=False)

    return build


@pytest.mark.parametrize("tau", [1.0, 0.5])
def test_cache_none_matches_the_shifting_reference_sampler(dream, make, tau):
    cfg, graphdef, params = dream
    ps = [prompts(1, seed=s, lo=p, hi=p)[0] for s, (p, _) in enumerate(CASES)]
    dec = make("none")
    for slot, (prompt, (_, gen)) in enumerate(zip(ps, CASES)):
        dec.admit(slot, prompt, gen, BLOCK)
    per_step = run_to_end(dec, {0: tau, 1: tau})
    for slot, (prompt, (_, gen)) in enumerate(zip(ps, CASES)):
        ref = generate(graphdef, params, cfg, prompt, gen, BLOCK, threshold=tau)
        assert dec.answer(slot) == ref.answer and per_step[slot] == ref.committed_per_step
    unshifted = generate(graphdef, params, cfg.replace(logits_shift=0), ps[0], CASES[0][1], BLOCK, threshold=tau)
    assert unshifted.answer != dec.answer(0)  # the shift decides the tokens: this test can tell


@pytest.mark.parametrize("mode", ["dual", "prefix"])
def test_cache_with_refresh_every_step_equals_cache_none(make, mode):
    ps = prompts(2, seed=3)
    want, got = make("none"), make(mode)
    for dec in (want, got):
        for slot, p in enumerate(ps):
            dec.admit(slot, p, 40, BLOCK)
    want_steps = run_to_end(want, {0: 0.5, 1: 0.5})
    got_steps = run_to_end(got, {0: 0.5, 1: 0.5}, force_refresh=True)
    assert got_steps == want_steps
    assert [got.canvas(s) for s in range(2)] == [want.canvas(s) for s in range(2)]


@pytest.mark.parametrize("mode", ["dual", "prefix"])
@pytest.mark.parametrize("tau", [1.0, 0.7])  # at 0.5 this sharp model fills each block in its refresh
def test_cache_modes_equal_the_plain_cached_sampler(dream, make, mode, tau):
    """Several layers (an approximate cache): reuse steps keep no K/V, yet every step commits what a
    sampler that keeps only the refresh's K/V and recomputes the row before the block commits."""
    cfg, graphdef, params = dream
    ps = [prompts(1, seed=7 + s, lo=p, hi=p)[0] for s, (p, _) in enumerate(CASES)]
    dec = make(mode)
    for slot, (prompt, (_, gen)) in enumerate(zip(ps, CASES)):
        dec.admit(slot, prompt, gen, BLOCK)
    per_step = run_to_end(dec, {0: tau, 1: tau})
    reuse_steps = 0
    for slot, (prompt, (_, gen)) in enumerate(zip(ps, CASES)):
        canvas, committed, reuses = plain_cached(graphdef, params, cfg, prompt, gen, BLOCK, tau, mode)
        assert per_step[slot] == committed
        assert dec.canvas(slot) == canvas.tolist()
        reuse_steps += reuses
    assert reuse_steps > 0  # the reuse path really ran


def _steps(dec: SlotDecoder, slot: int, tau: float) -> list[tuple[bool, tuple[int, ...]]]:
    """Run one slot to the end on the decoder's own refresh schedule: [(refresh?, positions)]."""
    out, steps = None, []
    while out is None or not out.request_finished:
        refresh = dec.needs_refresh(slot)
        out = dec.step(StepKind.REFRESH if refresh else StepKind.REUSE, [slot], [tau])[0]
        steps.append((refresh, out.positions))
    return steps


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dual", "prefix"])
def test_block_start_is_scored_by_the_row_before_the_block(mode):
    """With one layer, every position's K/V depend only on its own token and position, so the
    cache is exact and reuse steps must reproduce cache none token for token. A block's first
    position, still masked after the refresh, is then scored in a reuse step by the query row
    before the block: scoring it with any other row (e.g. its own) changes the answer."""
    cfg = test_dream().replace(n_layers=1)
    graphdef, params = random_dream_params(cfg, seed=2, head_scale=12.0)
    compiled = CompiledSteps(cfg, graphdef)
    tau, prompt, answer = 1.0, prompts(1, seed=2)[0][:12], 48
    runs = {}
    for m in ("none", mode):
        dec = SlotDecoder(cfg, graphdef, params, DecoderConfig(1, (LENGTH,), (BLOCK,), CacheMode(m)),
                          compiled=compiled, warm_up=False, progress=False)
        dec.admit(0, prompt, answer, BLOCK)
        runs[m] = (_steps(dec, 0, tau), dec.canvas(0))
    (want_steps, want_canvas), (got_steps, got_canvas) = runs["none"], runs[mode]
    assert got_canvas == want_canvas
    assert [pos for _, pos in got_steps] == [pos for _, pos in want_steps]
    block_starts_in_reuse = [pos[0] for refresh, pos in got_steps if not refresh and pos[0] % BLOCK == 0]
    assert block_starts_in_reuse, "no block start was committed by a reuse step: the boundary went untested"
    assert sum(refresh for refresh, _ in got_steps) <= answer // BLOCK  # one refresh per block, no more
