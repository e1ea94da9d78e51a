"""A request resumed on another decoder from its committed canvas (migration, failure re-queue).

Cache none: the tokens are those of an uninterrupted run. Dual/prefix: those of a run with a
refresh forced at the step where it moved (its cache is rebuilt there)."""
from dilaserve_jax.core.kinds import StepKind
import pytest

from fastdecode_support import prompts

TAU, GEN, BLOCK = 0.7, 40, 16


def _step_until(dec, slot, tau, stop_after=None, force_refresh_at=None):
    """Step one slot; stop after `stop_after` steps (None: to the end). Returns the commits per step."""
    commits, n = [], 0
    while stop_after is None or n < stop_after:
        refresh = dec.needs_refresh(slot) or n == force_refresh_at
        out = dec.step(StepKind.REFRESH if refresh else StepKind.REUSE, [slot], [tau])[0]
        commits.append(out.n_committed)
        n += 1
        if out.request_finished:
            break
    return commits


def _committed(dec, slot, prompt_len, answer_len, mask_id):
    area = dec.canvas(slot)[prompt_len:prompt_len + answer_len]
    return [None if t == mask_id else t for t in area]


@pytest.mark.parametrize("mode", ["none", "dual", "prefix"])
@pytest.mark.parametrize("moved_after", [1, 3, 5])
def test_resume_from_committed_canvas(make_decoder, sharp_model, mode, moved_after):
    cfg = sharp_model[0]
    prompt = prompts(1, seed=21)[0]
    whole = make_decoder(mode, slots=2)
    whole.admit(1, prompt, GEN, BLOCK)
    want = _step_until(whole, 1, TAU, force_refresh_at=None if mode == "none" else moved_after)

    first, second = make_decoder(mode, slots=2), make_decoder(mode, slots=3)
    first.admit(0, prompt, GEN, BLOCK)
    got = _step_until(first, 0, TAU, stop_after=moved_after)
    assert sum(got) < GEN, "moved before the end"
    canvas = _committed(first, 0, len(prompt), GEN, cfg.mask_id)
    second.admit(2, prompt, GEN, BLOCK, committed=canvas, steps_done=moved_after)
    assert second.needs_refresh(2)
    got += _step_until(second, 2, TAU)
    assert got == want
    assert second.answer(2) == whole.answer(1)
    assert second.canvas(2) == whole.canvas(1)


def test_resume_rejects_an_inconsistent_canvas(make_decoder, sharp_model):
    cfg = sharp_model[0]
    dec = make_decoder("dual", slots=1)
    prompt = prompts(1, seed=2)[0]
    with pytest.raises(ValueError, match="positions"):
        dec.admit(0, prompt, GEN, BLOCK, committed=[None] * (GEN - 1))
    with pytest.raises(ValueError, match="beyond the current block"):
        dec.admit(0, prompt, GEN, BLOCK, committed=[None] * 20 + [65] + [None] * (GEN - 21))
    with pytest.raises(ValueError, match="mask"):
        dec.admit(0, prompt, GEN, BLOCK, committed=[cfg.mask_id] + [None] * (GEN - 1))
    with pytest.raises(ValueError, match="masked position"):
        dec.admit(0, prompt, GEN, BLOCK, committed=[65] * GEN)
    assert dec.is_free(0)


def test_sampling_continues_with_the_step_count(make_decoder, sharp_model):
    """With temperature > 0 the sampling key folds in the step count: resumed with it, the draws
    are the uninterrupted run's."""
    cfg = sharp_model[0]
    prompt = prompts(1, seed=5)[0]
    whole = make_decoder("none", slots=1)
    whole.admit(0, prompt, GEN, BLOCK, temperature=1.5, seed=11)
    want = _step_until(whole, 0, TAU)
    first, second = make_decoder("none", slots=1), make_decoder("none", slots=1)
    first.admit(0, prompt, GEN, BLOCK, temperature=1.5, seed=11)
    got = _step_until(first, 0, TAU, stop_after=2)
    second.admit(0, prompt, GEN, BLOCK, temperature=1.5, seed=11,
                 committed=_committed(first, 0, len(prompt), GEN, cfg.mask_id), steps_done=2)
    got += _step_until(second, 0, TAU)
    assert got == want and second.answer(0) == whole.answer(0)
