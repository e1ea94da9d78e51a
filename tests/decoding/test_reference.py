import jax.numpy as jnp
import numpy as np
import pytest

from dilaserve_jax.decoding import reference
from dilaserve_jax.decoding.reference import commit_mask, generate, is_finished

PROMPT = [ord(c) for c in "sort 3142"]


def test_tau_one_commits_exactly_one_token_per_step(sharp_model):
    cfg, g, p = sharp_model
    result = generate(g, p, cfg, PROMPT, 24, 8, threshold=1.0)
    assert result.committed_per_step and set(result.committed_per_step) == {1}
    assert result.steps == len(result.committed_per_step)


def test_lower_threshold_never_needs_more_steps(sharp_model):
    cfg, g, p = sharp_model
    steps = [generate(g, p, cfg, PROMPT, 24, 8, threshold=t).steps for t in (1.0, 0.9, 0.7, 0.5, 0.3, 0.1)]
    assert steps == sorted(steps, reverse=True)
    assert steps[-1] < steps[0]  # the sharpened model really commits several tokens at low τ


def test_commit_rule_on_hand_built_confidences():
    masked = np.array([True, False, True, True, True])
    conf = np.array([0.5, 0.99, 0.95, 0.2, 0.95])
    assert commit_mask(masked, conf, 0.9).tolist() == [False, False, True, False, True]
    assert commit_mask(masked, conf, 1.0).tolist() == [False, False, True, False, False]  # tie -> lowest
    assert commit_mask(masked, np.full(5, 0.1), 0.9).sum() == 1


def test_eos_finishing_rule():
    mask, eos = 2, 1
    canvas = np.array([9, 9, 5, eos, mask, mask], np.int32)  # prompt len 2; answer "5" then EOS
    assert is_finished(canvas, 2, mask, eos)
    assert not is_finished(np.array([9, 9, mask, eos, mask], np.int32), 2, mask, eos)
    assert not is_finished(np.array([9, 9, 5, mask], np.int32), 2, mask, eos)


def test_generation_stops_at_first_eos(sharp_model, monkeypatch):
    """A model that proposes EOS at the third answer position with top confidence stops early."""
    cfg, g, p = sharp_model
    real = reference._logits

    def fake_logits(graphdef, params, canvas):
        logits = np.array(real(graphdef, params, canvas))
        logits[len(PROMPT) + 2, :] = -10.0
        logits[len(PROMPT) + 2, cfg.eos_id] = 100.0
        return jnp.asarray(logits)

    monkeypatch.setattr(reference, "_logits", fake_logits)
    result = generate(g, p, cfg, PROMPT, 24, 8, threshold=1.0)
    assert len(result.answer) == 2
    assert result.steps == 3  # EOS first (most confident), then the two positions before it
    assert (result.canvas[len(PROMPT) + 2:] == cfg.eos_id).all()


def test_sampling_is_deterministic_under_a_seed(sharp_model):
    cfg, g, p = sharp_model
    a = generate(g, p, cfg, PROMPT, 16, 8, threshold=0.9, temperature=1.0, seed=11)
    b = generate(g, p, cfg, PROMPT, 16, 8, threshold=0.9, temperature=1.0, seed=11)
    c = generate(g, p, cfg, PROMPT, 16, 8, threshold=0.9, temperature=1.0, seed=12)
    assert a.answer == b.answer and a.committed_per_step == b.committed_per_step
    assert a.canvas.tolist() != c.canvas.tolist()


def test_mask_token_is_never_committed(sharp_model, monkeypatch):
    cfg, g, p = sharp_model
    real = reference._logits

    def mask_loving(graphdef, params, canvas):
        logits = np.array(real(graphdef, params, canvas))
        logits[:, cfg.mask_id] = 1000.0
        return jnp.asarray(logits)

    monkeypatch.setattr(reference, "_logits", mask_loving)
    result = generate(g, p, cfg, PROMPT, 16, 8, threshold=0.5)
    assert cfg.mask_id not in result.canvas[len(PROMPT):].tolist()


def test_bad_arguments_are_rejected(sharp_model):
    cfg, g, p = sharp_model
    with pytest.raises(ValueError, match="threshold"):
        generate(g, p, cfg, PROMPT, 8, 8, threshold=0.0)
    with pytest.raises(ValueError, match="max_len"):
        generate(g, p, cfg, PROMPT, cfg.max_len, 8)
    with pytest.raises(ValueError, match="prompt"):
        generate(g, p, cfg, [], 8, 8)
