"""What a step writes into the slot state: a gathered reuse step never touches the K/V cache, one
on the whole state writes only positions that every reuse recomputes, a refresh writes only its own
slots' rows, and sampling rows and greedy rows never change each other's tokens."""
import numpy as np
from dilaserve_jax.core.kinds import StepKind
import pytest

from fastdecode_support import prompts, run_to_end

GEN, BLOCK = 40, 16


def _kv(dec):
    return [(np.asarray(layer.k).copy(), np.asarray(layer.v).copy()) for layer in dec.state.kv]


@pytest.mark.parametrize("mode", ["dual", "prefix"])
def test_reuse_steps_keep_the_refreshed_cache_and_refresh_writes_only_its_slots(make_decoder, mode):
    dec = make_decoder(mode)
    for slot, prompt in enumerate(prompts(3, seed=8)):
        dec.admit(slot, prompt, GEN, BLOCK)
    dec.step(StepKind.REFRESH, [0, 1, 2], [1.0] * 3)
    refreshed, canvas = _kv(dec), np.asarray(dec.state.canvas).copy()
    for _ in range(3):
        dec.step(StepKind.REUSE, [0, 2], [1.0, 1.0])
    for (k, v), layer in zip(refreshed, dec.state.kv):  # the cache is exactly the refresh's
        np.testing.assert_array_equal(np.asarray(layer.k), k)
        np.testing.assert_array_equal(np.asarray(layer.v), v)
    after = np.asarray(dec.state.canvas)
    np.testing.assert_array_equal(after[[1, 3]], canvas[[1, 3]])  # slots outside the step untouched
    for slot in (0, 2):  # three commits, all inside the slot's first block
        changed = np.flatnonzero(after[slot] != canvas[slot])
        start = len(prompts(3, seed=8)[slot])
        assert len(changed) == 3 and changed.min() >= start and changed.max() < start + BLOCK
    dec.step(StepKind.REFRESH, [1], [1.0])
    for (k, v), layer in zip(refreshed, dec.state.kv):
        for slot in (0, 2, 3):
            np.testing.assert_array_equal(np.asarray(layer.k)[slot], k[slot])
            np.testing.assert_array_equal(np.asarray(layer.v)[slot], v[slot])


@pytest.mark.parametrize("mode", ["dual", "prefix"])
def test_whole_state_reuse_writes_only_positions_every_reuse_recomputes(make_decoder, mode):
    """Three of four slots stepped with 4 slots (batch bucket = every slot: the step runs on the
    state in place) and with 8 (gathered): the same commits step by step and to the end. In place,
    the K/V of every row, the unstepped slot's too, differ from the refresh's only where a reuse
    recomputes them (the block and, with shifted logits, the row before it; in prefix mode also
    everything after the block), so nothing a later step reads has changed."""
    ps = prompts(4, seed=8)
    whole, gathered = make_decoder(mode), make_decoder(mode, slots=8)
    for dec in (whole, gathered):
        for slot, prompt in enumerate(ps):
            dec.admit(slot, prompt, GEN, BLOCK)
        dec.step(StepKind.REFRESH, [0, 1, 2, 3], [1.0] * 4)
    refreshed = _kv(whole)
    for _ in range(3):
        assert whole.step(StepKind.REUSE, [0, 1, 2], [1.0] * 3) == gathered.step(StepKind.REUSE, [0, 1, 2], [1.0] * 3)
    shift = whole.cfg.logits_shift
    for (k, v), layer in zip(refreshed, whole.state.kv):
        written = False
        for slot, prompt in enumerate(ps):
            start = len(prompt)
            end = start + BLOCK if mode == "dual" else start + GEN
            kept = np.r_[0:start - shift, end:k.shape[1]]
            np.testing.assert_array_equal(np.asarray(layer.k)[slot][kept], k[slot][kept])
            np.testing.assert_array_equal(np.asarray(layer.v)[slot][kept], v[slot][kept])
            written |= not np.array_equal(np.asarray(layer.k)[slot], k[slot])
        assert written  # the step did write in place (else this test checks nothing)
    taus = {slot: 1.0 for slot in range(4)}
    assert run_to_end(whole, taus) == run_to_end(gathered, taus)
    assert [whole.answer(s) for s in range(4)] == [gathered.answer(s) for s in range(4)]


def test_sampled_and_greedy_rows_do_not_change_each_other(make_decoder):
    sampled, greedy = prompts(2, seed=31)
    alone = {}
    # the test model is sharpened (confident), so only a high temperature samples away from greedy
    for name, prompt, temperature in (("sampled", sampled, 30.0), ("greedy", greedy, 0.0),
                                      ("sampled prompt, greedy", sampled, 0.0)):
        dec = make_decoder("dual")
        dec.admit(0, prompt, GEN, BLOCK, temperature=temperature, seed=5)
        steps = run_to_end(dec, {0: 0.7})[0]
        alone[name] = (dec.answer(0), steps)
    dec = make_decoder("dual")
    dec.admit(1, sampled, GEN, BLOCK, temperature=30.0, seed=5)
    dec.admit(3, greedy, GEN, BLOCK)
    steps = run_to_end(dec, {1: 0.7, 3: 0.7})
    assert (dec.answer(1), steps[1]) == alone["sampled"]
    assert (dec.answer(3), steps[3]) == alone["greedy"]  # its batch now draws noise; its tokens do not
    assert alone["sampled"][0] != alone["sampled prompt, greedy"][0]  # sampling really is on
