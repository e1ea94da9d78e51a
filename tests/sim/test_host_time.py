"""The host-time model: fitted on a recorded real run, it reproduces that run's host time per iteration
(mean and spread, overall and per queue depth), and the simulator charges it with every step."""
import json
from pathlib import Path

import numpy as np

from dilaserve_jax.serving.cluster.fake_runner import fake_profile
from dilaserve_jax.serving.policy.latency import LatencyModel
from dilaserve_jax.sim.executor import ModelledRunner, StepTimeModel, VirtualClock
from dilaserve_jax.sim.host_time import MIN_BIN_SAMPLES, HostBin, HostTimeModel
from dilaserve_jax.sim.quality import QualityModel, make_plan
from dilaserve_jax.sim.setup import ASSETS
from dilaserve_jax.core.kinds import StepKind

FIXTURE = Path(__file__).parent / "data" / "host_samples_dilaserve.json"


def _samples():
    return [(int(b), int(q), float(h)) for b, q, h in json.loads(FIXTURE.read_text())["samples"]]


def test_fitted_model_reproduces_the_recorded_mean_and_spread():
    samples = _samples()
    model = HostTimeModel.fit(samples)
    rng = np.random.default_rng(0)
    recorded = np.array([h for _, _, h in samples])
    drawn = np.array([model.sample(b, q, rng) for _ in range(20) for b, q, _ in samples])
    assert abs(drawn.mean() / recorded.mean() - 1) < 0.03
    assert abs(drawn.std() / recorded.std() - 1) < 0.10
    for lo, hi in ((0, 4), (8, 32)):  # host time grows with the queue; each depth keeps its own level
        rec = [h for b, q, h in samples if lo <= q < hi]
        sim = [model.sample(b, q, rng) for _ in range(20) for b, q, h in samples if lo <= q < hi]
        assert abs(np.mean(sim) / np.mean(rec) - 1) < 0.05
        assert abs(np.percentile(sim, 90) / np.percentile(rec, 90) - 1) < 0.10
    assert np.mean([h for _, q, h in samples if q >= 8]) > 1.5 * np.mean([h for _, q, h in samples if q == 0])
    assert all(len(b.residuals) >= MIN_BIN_SAMPLES for b in model.bins)


def test_a_deeper_queue_than_recorded_uses_the_deepest_bin_and_json_round_trips():
    model = HostTimeModel.fit(_samples())
    deepest = max(q for _, q, _ in _samples())
    assert model.mean(2, 10 * deepest) == model.mean(2, deepest)
    back = HostTimeModel.from_json(json.loads(json.dumps(model.to_json())))
    assert back == model
    assert "queue 0+" in model.describe()


def test_the_modelled_runner_charges_host_time_on_batch_and_queue():
    host = HostTimeModel((HostBin(0, 1e-3, 1e-4, ()), HostBin(8, 5e-3, 0.0, ())))
    step = StepTimeModel(LatencyModel.from_profile(fake_profile()))
    quality = QualityModel.from_eval_rows(json.loads((ASSETS / "eval.json").read_text()))
    task = quality.tasks[0]
    plans = {1: make_plan(quality, 1, task, 32, 32)}
    times = {}
    for queue in (0, 20):
        clock = VirtualClock()
        runner = ModelledRunner(2, 1, clock, step, quality, plans, host_time=host)
        runner.queue_depth = lambda q=queue: q
        runner.admit(0, (5,) * 16, 32, 32, seed=1)
        runner.step(StepKind.REFRESH, [0], [0.9], [0])
        times[queue] = (clock(), runner.last_host_s)
    base = step.batch_seconds(StepKind.REFRESH, [(48, 32)], 1, np.random.default_rng(0))
    assert times[0][1] == 1e-3 + 1e-4 and times[20][1] == 5e-3
    assert abs(times[0][0] - (base + 1.1e-3)) < 1e-12 and abs(times[20][0] - (base + 5e-3)) < 1e-12
