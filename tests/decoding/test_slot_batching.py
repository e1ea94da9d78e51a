"""Batch invariance, per-slot thresholds and padding safety of the slot-batched steps (dual cache)."""
import numpy as np
from dilaserve_jax.core.kinds import StepKind
import pytest

from fastdecode_support import prompts, run_to_end

GEN, BLOCK = 40, 16


def _solo(make_decoder, prompt, tau, mode="dual"):
    dec = make_decoder(mode)
    dec.admit(0, prompt, GEN, BLOCK)
    steps = run_to_end(dec, {0: tau})[0]
    return dec.answer(0), dec.canvas(0), steps


@pytest.fixture(scope="module")
def solo(make_decoder):
    target = prompts(1, seed=21)[0]
    return target, {tau: _solo(make_decoder, target, tau) for tau in (1.0, 0.5)}


@pytest.mark.parametrize("slot,n_others", [(3, 3), (1, 2), (2, 1)])
def test_output_does_not_depend_on_batch_slot_or_bucket(make_decoder, solo, slot, n_others):
    """The target request shares every step with n_others (batch bucket 4 with 0-2 padding rows, or 2)."""
    target, want = solo
    dec = make_decoder("dual")
    others = prompts(n_others, seed=100 + slot, lo=4, hi=24)
    free = [s for s in range(4) if s != slot]
    taus = {slot: 0.5}
    dec.admit(slot, target, GEN, BLOCK)
    for s, p in zip(free, others):
        dec.admit(s, p, GEN - 8 * (s % 2), BLOCK)  # different lengths: others finish at other times
        taus[s] = [1.0, 0.7, 0.9][s % 3]
    steps = run_to_end(dec, taus)
    answer, canvas, solo_steps = want[0.5]
    assert dec.answer(slot) == answer
    assert dec.canvas(slot) == canvas
    assert steps[slot] == solo_steps


def test_mixed_thresholds_in_one_batch(make_decoder, solo):
    """The same request at τ = 1.0 and τ = 0.5 side by side: each slot follows its own τ exactly."""
    target, want = solo
    dec = make_decoder("dual")
    dec.admit(0, target, GEN, BLOCK)
    dec.admit(2, target, GEN, BLOCK)
    steps = run_to_end(dec, {0: 1.0, 2: 0.5})
    assert set(steps[0]) == {1}
    assert max(steps[2]) > 1
    assert (dec.answer(0), steps[0]) == (want[1.0][0], want[1.0][2])
    assert (dec.answer(2), steps[2]) == (want[0.5][0], want[0.5][2])


@pytest.mark.parametrize("slots", [4, 8])
def test_rows_outside_the_step_keep_their_state(make_decoder, slots):
    """Steps over 3 real slots (bucket 4: one padding row out of 8 slots, gathered; or, with 4 slots,
    on the whole state in place) leave the fourth slot's canvas, scalars and K/V as they were — but
    for the in-place reuse step's K/V at the positions a reuse of that slot would recompute itself
    (its block), which no step ever reads (tests/decoding/test_step_writes.py)."""
    dec = make_decoder("dual", slots=slots)
    ps = prompts(4, seed=5)
    for s, p in enumerate(ps):
        dec.admit(s, p, GEN, BLOCK)
    before = {f: np.asarray(getattr(dec.state, f))[3].copy() for f in ("canvas", "block_start", "steps")}
    kv_before = [np.asarray(layer.k)[3].copy() for layer in dec.state.kv]
    dec.step(StepKind.REFRESH, [0, 1, 2], [1.0] * 3)
    dec.step(StepKind.REUSE, [0, 1, 2], [1.0] * 3)
    for field, value in before.items():
        np.testing.assert_array_equal(np.asarray(getattr(dec.state, field))[3], value)
    start = len(ps[3])
    kept = np.r_[0:start, start + BLOCK:kv_before[0].shape[0]] if slots == 4 else np.arange(kv_before[0].shape[0])
    for layer, k in zip(dec.state.kv, kv_before):
        np.testing.assert_array_equal(np.asarray(layer.k)[3][kept], k[kept])
    if slots == 8:
        for layer, k in zip(dec.state.kv, kv_before):
            np.testing.assert_array_equal(np.asarray(layer.k)[3], k)


def test_step_rejects_protocol_violations(make_decoder):
    dec = make_decoder("dual")
    dec.admit(0, [5, 6, 7], 16, BLOCK)
    with pytest.raises(ValueError, match="refresh"):
        dec.step(StepKind.REUSE, [0], [0.9])
    with pytest.raises(ValueError, match="holds no request"):
        dec.step(StepKind.REFRESH, [1], [0.9])
    with pytest.raises(ValueError, match="duplicate"):
        dec.step(StepKind.REFRESH, [0, 0], [0.9, 0.9])
    with pytest.raises(ValueError, match="τ"):
        dec.step(StepKind.REFRESH, [0], [0.0])
    with pytest.raises(ValueError, match="occupied"):
        dec.admit(0, [5], 8, BLOCK)
    with pytest.raises(ValueError, match="bucket"):
        dec.admit(1, [5] * 30, 40, BLOCK)  # 70 positions > the 64 bucket
