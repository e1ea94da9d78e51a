"""The profiler times real compiled steps of the `test` preset; the eval-rows prior loader."""
import json

import pytest

from dilaserve_jax.models import load_model
from dilaserve_jax.serving.policy.latency import LatencyModel, Profile
from dilaserve_jax.serving.executor.profiling import measure_profile, refresh_reuse_ratios
from dilaserve_jax.serving.executor.runner import JaxRunner
from dilaserve_jax.serving.policy.eval_rows import prior_from_eval_json
from dilaserve_jax.serving.policy.threshold_config import ThresholdConfig, TokensPerStep
from dilaserve_jax.core.kinds import StepKind


@pytest.fixture(scope="module")
def runner():
    m = load_model("test")
    return JaxRunner(m.config, m.graphdef, m.params, num_slots=2, length_buckets=(32,), block_buckets=(8,),
                     warm_up=False, progress=False)


def _decode(runner, prompt, tau=0.7):
    runner.admit(0, prompt, 16, 8)
    while True:
        kind = StepKind.REFRESH if runner.decoder.needs_refresh(0) else StepKind.REUSE
        if runner.step(kind, [0], [tau])[0].request_finished:
            break
    out = runner.decoder.canvas(0)
    runner.release(0)
    return out


@pytest.mark.slow
def test_profile_covers_the_grid_with_measured_points_and_leaves_the_slots_free(runner, tmp_path):
    before = _decode(runner, [5, 6, 7, 8, 9])
    grid = dict(batches=(1, 2), lengths=(8, 32), blocks=(8,))  # block 8 does not fit an 8-canvas: skipped
    profile = measure_profile(runner, **grid, repeats=2, progress=False)
    assert not profile.analytic and profile.model == "test" and "cpu" in profile.device
    assert "measured" in profile.label and "test" in profile.label
    keys = sorted((p.kind, p.batch, p.canvas, p.block, p.tp) for p in profile.points)
    assert keys == sorted((k, b, 32, 8, runner.tp_degree) for k in StepKind for b in (1, 2))
    assert all(0 < p.seconds < 10 for p in profile.points)
    assert all(runner.decoder.is_free(s) for s in range(runner.num_slots))
    # the dummy requests left nothing behind: the same request decodes to the same canvas
    assert _decode(runner, [5, 6, 7, 8, 9]) == before
    path = tmp_path / "p.json"
    profile.save(path)
    assert Profile.load(path) == profile
    model = LatencyModel.from_profile(profile, holdout_fraction=0.0)
    assert model.predict(StepKind.REFRESH, 2, 32, 8) > 0 and not model.analytic
    assert set(refresh_reuse_ratios(profile)[32]) == {1, 2}


@pytest.mark.slow
def test_profile_accepts_a_decoder_and_rejects_impossible_grids(runner):
    dec = runner.decoder
    prof = measure_profile(dec, batches=(1,), lengths=(32,), blocks=(8,), repeats=1, progress=False)
    assert [p.kind for p in prof.points] == [StepKind.REFRESH, StepKind.REUSE]
    with pytest.raises(ValueError, match="free slots"):
        measure_profile(runner, batches=(4,), lengths=(32,), blocks=(8,), progress=False)
    with pytest.raises(ValueError, match="length bucket"):
        measure_profile(runner, batches=(1,), lengths=(64,), blocks=(8,), progress=False)
    with pytest.raises(ValueError, match="no block"):
        measure_profile(runner, batches=(1,), lengths=(8,), blocks=(8,), progress=False)
    with pytest.raises(TypeError):
        measure_profile(object(), batches=(1,), lengths=(32,), blocks=(8,), progress=False)
    runner.admit(1, [5, 6, 7], 8, 8)  # a busy slot is not used
    try:
        with pytest.raises(ValueError, match="1 free of 2"):
            measure_profile(runner, batches=(2,), lengths=(32,), blocks=(8,), progress=False)
    finally:
        runner.release(1)


def test_prior_from_eval_rows_pools_tokens_over_steps(tmp_path):
    rows = [
        {"task": "a", "kind": "deterministic", "threshold": 0.9, "accuracy": 1.0, "tokens_per_step": 2.0, "steps": 8.0, "n": 10},
        {"task": "b", "kind": "multi-answer", "threshold": 0.9, "accuracy": 1.0, "tokens_per_step": 4.0, "steps": 2.0, "n": 10},
        {"task": "a", "kind": "deterministic", "threshold": 1.0, "accuracy": 1.0, "tokens_per_step": 0.5, "steps": 16.0, "n": 10},
        {"task": "mean:all", "kind": "summary", "threshold": 0.9, "accuracy": 1.0, "tokens_per_step": 3.0, "steps": 5.0, "n": 20},
    ]
    prior = prior_from_eval_json(rows)
    assert prior == {1.0: 1.0, 0.9: pytest.approx((2 * 8 + 4 * 2) / 10)}  # pooled, not 3.0; clamped to >= 1
    assert prior_from_eval_json(rows, tasks=("b",)) == {0.9: 4.0}
    path = tmp_path / "eval.json"
    path.write_text(json.dumps([r for r in rows if r["kind"] == "summary"]))
    assert prior_from_eval_json(path) == {0.9: 3.0}
    tps = TokensPerStep(ThresholdConfig.with_prior(prior))
    assert tps.rate(0.9) == pytest.approx(2.4)
    with pytest.raises(ValueError):
        prior_from_eval_json([])
