"""The modelled executor: replayed trajectories, τ interpolation, validity, published tables, step times."""
import json
import math

import numpy as np
import pytest

from dilaserve_jax.serving.cluster.fake_runner import fake_profile
from dilaserve_jax.serving.policy.latency import LatencyModel
from dilaserve_jax.core.kinds import StepKind
from dilaserve_jax.sim.executor import ModelledRunner, StepTimeModel, VirtualClock, advance
from dilaserve_jax.sim.quality import LLADA_8B_GSM8K, Progress, QualityModel, make_plan
from dilaserve_jax.sim.setup import ASSETS


def _rows():
    """Two problems of one task (answer 64, block 32) at τ 1.0 and 0.5."""
    def row(tau, trajs, valid):
        return {"task": "t", "kind": "deterministic", "threshold": tau, "accuracy": sum(valid) / len(valid),
                "tokens_per_step": 1.0, "steps": 1.0, "n": len(trajs), "answer_length": 64, "block_length": 32,
                "trajectories": trajs, "valid": valid}
    return [row(1.0, [[1] * 40, [1] * 64], [1, 1]),
            row(0.5, [[20, 12, 8], [31, 1, 16, 16]], [0, 1])]


def _run(model, plan, taus):
    prog, out = Progress(), []
    for tau in taus:
        first, n, block_done, finished = advance(model, plan, prog, tau)
        out.append((first, n, block_done, finished))
        if finished:
            break
    return out


def _template_for(model, problem):
    """A request key whose drawn template is measured problem `problem`."""
    pool = model.templates["t"]
    return next(k for k in range(1, 1000) if model.template("t", k) is pool[problem])


def test_a_request_replays_its_problem_exactly_at_a_measured_tau():
    m = QualityModel.from_eval_rows(_rows())
    key = _template_for(m, 1)
    plan = make_plan(m, key, "t", 64, 32)
    steps = _run(m, plan, [0.5] * 10)
    assert [n for _, n, _, _ in steps] == [31, 1, 16, 16]
    assert [d for _, _, d, _ in steps] == [False, True, False, True] and steps[-1][3]
    assert [f for f, _, _, _ in steps] == [0, 31, 32, 48]  # positions follow on, block by block
    key0 = _template_for(m, 0)
    # problem 0 ends early (its EOS in block 1): 40 positions at τ 1.0, one per step
    steps0 = _run(m, make_plan(m, key0, "t", 64, 32), [1.0] * 100)
    assert len(steps0) == 40 and steps0[-1][3]


def test_between_grid_taus_steps_mix_the_neighbours_and_validity_interpolates():
    m = QualityModel.from_eval_rows(_rows())
    counts = []
    for key in range(1, 400):
        if m.template("t", key) is not m.templates["t"][1]:
            continue
        counts.append(len(_run(m, make_plan(m, key, "t", 64, 32), [0.75] * 100)))
    assert 4 < np.mean(counts) < 64  # between the τ 0.5 (4 steps) and τ 1.0 (64 steps) trajectories
    plan = make_plan(m, _template_for(m, 0), "t", 64, 32)
    assert m.valid_probability(plan, [(1.0, 10)]) == 1.0
    assert m.valid_probability(plan, [(0.5, 10)]) == 0.0
    assert m.valid_probability(plan, [(1.0, 10), (0.5, 30)]) == pytest.approx(0.25)
    assert m.valid_probability(plan, [(0.75, 8)]) == pytest.approx(0.5)


def test_shipped_eval_rows_reproduce_their_own_means():
    rows = json.loads((ASSETS / "eval.json").read_text())
    m = QualityModel.from_eval_rows(rows)
    for r in rows:
        if r.get("kind") == "summary":
            continue
        assert m.accuracy(r["task"], r["threshold"]) == pytest.approx(r["accuracy"])
        assert m.tokens_per_step(r["task"], r["threshold"]) == pytest.approx(r["tokens_per_step"])


def test_rows_without_trajectories_are_refused():
    rows = [{k: v for k, v in r.items() if k not in ("trajectories", "valid")} for r in _rows()]
    with pytest.raises(ValueError, match="trajectories"):
        QualityModel.from_eval_rows(rows)


def test_published_table_rates_accuracy_and_spread():
    m = QualityModel.from_table("llada_8b", seed=1)
    assert m.table_rate(1.0) == 1.0 and m.table_rate(0.9) == pytest.approx(16.5 / 6.7)
    assert m.table_accuracy(1.0) == pytest.approx(0.793) and m.table_accuracy(0.9) == pytest.approx(0.792)
    assert m.extrapolated_below == 0.9 and m.table_accuracy(0.6) < m.table_accuracy(0.9)
    steps = []
    for key in range(1, 300):
        plan = make_plan(m, key, "gsm8k", 256, 32, finish_tokens=200)
        out = _run(m, plan, [0.9] * 1000)
        assert out[-1][3] and sum(n for _, n, _, _ in out) == 200  # ends at the EOS the workload asked for
        steps.append(len(out))
    mean_rate = 200 / np.mean(steps)
    assert 1.6 < mean_rate < 2.6  # ceil() per block costs a little of the table's 2.46 per step
    assert np.std(steps) > 1  # per-request and per-block spread, not the mean alone
    with pytest.raises(ValueError, match="published"):
        QualityModel.from_table("nope")
    assert LLADA_8B_GSM8K["source"].startswith("Fast-dLLM")


def test_runner_charges_grouped_bucketed_step_times_and_resumes():
    latency = LatencyModel.from_profile(fake_profile())
    st = StepTimeModel(latency, length_buckets=(64, 128), batch_buckets=(1, 2, 4))
    one = st.mean(StepKind.REFRESH, 1, 64, 16, 1)
    two = st.mean(StepKind.REFRESH, 2, 128, 16, 1)
    rng = np.random.default_rng(0)
    # two requests of different length buckets run as two compiled steps, back to back
    assert st.batch_seconds(StepKind.REFRESH, [(40, 16), (100, 16)], 1, rng) == pytest.approx(
        one + st.mean(StepKind.REFRESH, 1, 128, 16, 1))
    assert st.batch_seconds(StepKind.REFRESH, [(100, 16), (120, 16)], 1, rng) == pytest.approx(two)
    m = QualityModel.from_eval_rows(_rows())
    plans = {7: make_plan(m, 7, "t", 64, 32)}
    clock = VirtualClock(5.0)
    runner = ModelledRunner(2, 1, clock, StepTimeModel(latency), m, plans)
    runner.admit(0, (3,) * 20, 64, 32, seed=7)
    outs = runner.step(StepKind.REFRESH, [0], [0.5])
    assert clock() > 5.0 and outs[0].n_committed >= 1
    wrong = StepKind.REUSE if outs[0].block_finished else StepKind.REFRESH  # the next kind must be the right one
    with pytest.raises(ValueError, match="needs"):
        runner.step(wrong, [0], [0.5])
    # a resumed request continues from its committed prefix, with a refresh
    runner.admit(1, (3,) * 20, 64, 32, seed=7, committed=[1] * 32 + [None] * 32, steps_done=3)
    assert runner.step(StepKind.REFRESH, [1], [0.5])[0].positions[0] == 32
    with pytest.raises(KeyError):  # a request the simulator did not plan
        ModelledRunner(1, 1, VirtualClock(), StepTimeModel(latency), m, plans).admit(0, (3,), 64, 32, seed=99)


def test_noise_is_multiplicative_and_reproducible():
    latency = LatencyModel.from_profile(fake_profile())
    st = StepTimeModel(latency, noise=0.2)
    a = [st.batch_seconds(StepKind.REUSE, [(128, 16)] * 2, 1, np.random.default_rng(3)) for _ in range(3)]
    assert a[0] == a[1] == a[2]
    xs = [st.batch_seconds(StepKind.REUSE, [(128, 16)] * 2, 1, np.random.default_rng(s)) for s in range(400)]
    base = StepTimeModel(latency).batch_seconds(StepKind.REUSE, [(128, 16)] * 2, 1, np.random.default_rng(0))
    assert np.mean(xs) == pytest.approx(base, rel=0.05) and np.std(xs) / base == pytest.approx(0.2, rel=0.25)
    with pytest.raises(ValueError):
        StepTimeModel(latency, noise=-1.0)
    assert math.isfinite(base)


def test_a_slowdown_timeline_stretches_only_the_work_inside_it():
    latency = LatencyModel.from_profile(fake_profile())
    st = StepTimeModel(latency, timeline=((0.0, 1.0), (1.0, 2.0), (1.5, 1.0)))
    assert st._stretched(0.5, 0.25) == pytest.approx(0.25)  # before the slow spell
    assert st._stretched(0.9, 0.5) == pytest.approx(0.1 + 2 * 0.25 + 0.15)  # through it: 0.25 of work at half speed
    assert st._stretched(2.0, 1.0) == pytest.approx(1.0) and st._stretched(-1.0, 0.5) == pytest.approx(0.5)
    rng = np.random.default_rng(0)
    plain = StepTimeModel(latency).batch_seconds(StepKind.REUSE, [(128, 16)], 1, rng)
    assert StepTimeModel(latency, timeline=((0.0, 3.0),)).batch_seconds(StepKind.REUSE, [(128, 16)], 1, rng, 5.0) == \
        pytest.approx(3 * plain)
