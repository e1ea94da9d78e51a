"""The serving accuracy budget, run unchanged in the simulator: the eval rows (measured or published)
build it, a modelled request reports its first-step evidence, and the report carries the drop."""
import numpy as np
import pytest

from dilaserve_jax.serving.cluster.fake_runner import fake_profile
from dilaserve_jax.serving.policy.threshold import ThresholdConfig
from dilaserve_jax.core.kinds import StepKind
from dilaserve_jax.sim.executor import ModelledRunner, VirtualClock
from dilaserve_jax.sim.quality import LLADA_8B_GSM8K, QualityModel, make_plan
from dilaserve_jax.sim.report import summarize
from dilaserve_jax.sim.setup import setup_model
from dilaserve_jax.sim.simulator import SimConfig, Simulation
from dilaserve_jax.sim.slos import assign_slos
from dilaserve_jax.sim.workload import RequestSpec, TinyShapes, arrival_times, build_shapes, parse_slo


def test_published_table_as_eval_rows_builds_the_serving_budget():
    q = QualityModel.from_table("llada_8b")
    rows = q.eval_rows()
    tcfg = ThresholdConfig.from_eval(rows, max_accuracy_drop=1.0)
    acc = dict(tcfg.quality.model.pooled)
    for tau, rate, accuracy in LLADA_8B_GSM8K["points"]:  # the cited numbers, unchanged
        assert acc[tau] == pytest.approx(accuracy)
        assert dict(tcfg.prior)[tau] == pytest.approx(rate)
    assert tcfg.quality.model.loss(0.9, 0.9) == 0.0
    assert tcfg.quality.model.loss(0.5, 0.9) == pytest.approx(100 * (q.table_accuracy(0.9) - q.table_accuracy(0.5)))


def test_first_step_reports_the_task_signature_once():
    q = QualityModel.from_table("llada_8b")
    q.signatures["gsm8k"] = (0.5, 0.0, 0.25, 0.25)
    plan = make_plan(q, 7, "gsm8k", 64, 32, 40)
    assert sum(plan.first_counts) == 32 and plan.first_counts[1] == 0
    assert plan.first_counts == make_plan(q, 7, "gsm8k", 64, 32, 40).first_counts  # fixed by the key
    runner = ModelledRunner(1, 1, VirtualClock(), setup_model("llada_8b", "h100").step_time, q, {7: plan})
    runner.admit(0, (0,) * 10, 64, 32, seed=7)
    first = runner.step(StepKind.REFRESH, [0], [0.9])[0]
    assert first.confidence_counts == plan.first_counts
    kind = StepKind.REFRESH if first.block_finished else StepKind.REUSE
    assert runner.step(kind, [0], [0.9])[0].confidence_counts == ()


def _tiny_run(tmp_path, budget, seed=0):
    prof = tmp_path / "profile.json"
    fake_profile(canvases=(64, 128, 256)).save(prof)
    m = setup_model("tiny", str(prof), seed=seed)
    rng = np.random.default_rng(seed)
    times = arrival_times("poisson:60", duration=4.0, rate_scale=1.0, rng=rng)
    shapes = build_shapes("tiny", len(times), rng, trace=None, from_trace_rows=False, max_len=m.max_len,
                          tiny=TinyShapes(seed=seed))
    specs = [RequestSpec(float(t), s.task, s.prompt_tokens, s.answer_length, s.block_length, s.finish_tokens,
                         problem=s.problem) for t, s in zip(times, shapes)]
    specs = assign_slos(specs, parse_slo("idle:1.5,3"), quality=m.quality, step_time=m.step_time, tau=0.9, tp=1,
                        seed=seed)
    cfg = SimConfig(devices=1, policy="dilaserve", layout="1x1", tau_min=0.3, tau_max=0.9, max_accuracy_drop=budget,
                    seed=seed)
    res = Simulation(cfg, specs, step_time=m.step_time, latency=m.latency, quality=m.quality, prior=m.prior,
                     param_bytes=m.param_bytes, eval_rows=m.eval_rows).run()
    return res, summarize(res.records)


@pytest.mark.slow
def test_tiny_budget_bounds_the_predicted_loss(tmp_path):
    zero, s0 = _tiny_run(tmp_path, 0.0)
    one, s1 = _tiny_run(tmp_path, 1.0)
    free, sf = _tiny_run(tmp_path, None)
    ok = [r for r in zero.records if r.state == "FINISHED_OK"]
    assert ok and all(r.predicted_loss == 0.0 for r in ok)  # budget 0: nothing is spent
    assert sf["predicted_loss_points"] > s1["predicted_loss_points"]  # the bound binds under this overload
    assert s1["predicted_loss_points"] <= 1.0 + 1e-9
    assert sf["mean_tau"] < s1["mean_tau"] <= s0["mean_tau"]
    for s in (s0, s1, sf):
        assert 0.0 <= s["expected_accuracy"] <= 1.0 and np.isfinite(s["accuracy_drop_points"])
