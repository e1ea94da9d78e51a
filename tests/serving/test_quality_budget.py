"""Quality-aware threshold control: accuracy model, loss budget and per-request evidence (fake runner, no JAX)."""
import json
from pathlib import Path

import numpy as np
import pytest

from serving_support import req
from dilaserve_jax.serving.cluster.engine import Engine
from dilaserve_jax.serving.cluster.fake_runner import FakeClock, FakeRunner
from dilaserve_jax.serving.policy.accuracy import AccuracyModel, changed_commits, curve_loss
from dilaserve_jax.serving.policy.quality import QualityBudget, QualityConfig
from dilaserve_jax.serving.policy.request import Request, RequestState
from dilaserve_jax.serving.policy.scheduler import Scheduler, SchedulerConfig
from dilaserve_jax.serving.policy.eval_rows import accuracy_from_eval_json, prior_from_eval_json, read_eval_rows
from dilaserve_jax.serving.policy.threshold_config import TAU_GRID, ThresholdConfig

TAUS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5)
SAFE_ACC = dict(zip(TAUS, (0.95, 0.95, 0.95, 0.95, 0.95, 0.94)))
RISKY_ACC = dict(zip(TAUS, (0.95, 0.95, 0.80, 0.50, 0.30, 0.20)))
RATE = dict(zip(TAUS, (1.0, 2.0, 2.6, 3.2, 3.9, 4.7)))
SAFE_SIG = (0, 0, 0, 0, 0, 0, 0, 0, 0.05, 0.95)
RISKY_SIG = (0, 0, 0, 0, 0, 0.3, 0.3, 0.2, 0.1, 0.1)
SAFE_COUNTS = (0, 0, 0, 0, 0, 0, 0, 0, 1, 15)  # a 16-token block at the first step
RISKY_COUNTS = (0, 0, 0, 0, 0, 5, 5, 3, 2, 1)


def eval_rows(answer_length=64):
    rows = []
    for task, acc, sig in (("safe", SAFE_ACC, SAFE_SIG), ("risky", RISKY_ACC, RISKY_SIG)):
        for tau in TAUS:
            rows.append({"task": task, "kind": "multi-answer", "threshold": tau, "accuracy": acc[tau],
                         "tokens_per_step": RATE[tau], "steps": answer_length / RATE[tau], "n": 50,
                         "answer_length": answer_length, "first_step_confidence": list(sig)})
    return rows


def counts_of(prompt):  # the fake runner's first-step histogram: first prompt token 1 = safe, 2 = risky
    return SAFE_COUNTS if prompt[0] == 1 else RISKY_COUNTS


def make(latency, budget, mode="adaptive", slots=4, **quality):
    clock = FakeClock()
    tcfg = ThresholdConfig.from_eval(eval_rows(), max_accuracy_drop=budget, budget_mode=mode)
    if quality:
        tcfg = ThresholdConfig.with_prior(dict(tcfg.prior), quality=QualityConfig(tcfg.quality.model,
                                                                                   max_accuracy_drop=budget, **quality))
    runner = FakeRunner(slots, clock, confidence=counts_of)
    return Engine(runner, Scheduler(SchedulerConfig(slots, threshold=tcfg), latency), clock), clock


def step_taus(engine):
    return [t for _, _, taus in engine.runner.steps_run for t in taus]


def burst(engine, n=12, slo=0.13, **kw):
    hs = [engine.submit(req(f"r{i}", 0.0, slo + 0.004 * i, first_token=1 + i % 2, **kw)) for i in range(n)]
    engine.run_until_idle()
    return [h.result(0) for h in hs]


# --- the eval rows ---

def test_parser_reads_accuracy_pooled_like_the_speed_prior():
    rows = [{"task": "a", "threshold": 0.9, "accuracy": 1.0, "tokens_per_step": 2.0, "steps": 6.0, "n": 10},
            {"task": "b", "threshold": 0.9, "accuracy": 0.5, "tokens_per_step": 4.0, "steps": 3.0, "n": 30},
            {"task": "mean:all", "kind": "summary", "threshold": 0.9, "accuracy": 0.0, "tokens_per_step": 9.0,
             "steps": 1.0, "n": 40}]
    assert accuracy_from_eval_json(rows) == {0.9: pytest.approx((10 * 1.0 + 30 * 0.5) / 40)}
    assert prior_from_eval_json(rows) == {0.9: pytest.approx((2 * 60 + 4 * 90) / 150)}
    assert accuracy_from_eval_json(rows, tasks=("b",)) == {0.9: 0.5}


@pytest.mark.parametrize("reader", [read_eval_rows, prior_from_eval_json, accuracy_from_eval_json, AccuracyModel.from_eval])
def test_parser_refuses_rows_without_accuracy(tmp_path, reader):
    path = tmp_path / "speed_only.json"
    path.write_text(json.dumps([{"task": "a", "threshold": 0.9, "tokens_per_step": 2.0, "steps": 6.0, "n": 10}]))
    with pytest.raises(ValueError, match="accuracy") as err:
        reader(path)
    assert "speed_only.json" in str(err.value) and "row 0" in str(err.value)


def test_shipped_eval_rows_give_both_priors_on_the_grid():
    path = Path(__file__).parents[2] / "dilaserve_jax" / "assets" / "tiny" / "eval.json"
    model = AccuracyModel.from_eval(path)
    measured = {float(r["threshold"]) for r in read_eval_rows(path)}
    assert {1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.6, 0.5} <= measured <= set(TAU_GRID)
    assert {p.name for p in model.profiles} == {"sort", "upper", "repeat", "altcase"}
    assert all(p.signature and p.answer_length for p in model.profiles)
    assert set(prior_from_eval_json(path)) == measured


# --- the accuracy model ---

def test_loss_is_monotone_and_relative_to_tau_max():
    bumpy = ((0.5, 0.7), (0.7, 0.99), (0.9, 0.9), (1.0, 0.95))  # better at 0.7 than at 1.0: no gain counted
    assert curve_loss(bumpy, 1.0, 1.0) == 0.0
    assert curve_loss(bumpy, 0.9, 1.0) == pytest.approx(5.0)
    assert curve_loss(bumpy, 0.7, 1.0) == pytest.approx(5.0)
    assert curve_loss(bumpy, 0.5, 1.0) == pytest.approx(25.0)
    assert curve_loss(bumpy, 0.7, 0.7) == 0.0 and curve_loss(bumpy, 0.5, 0.7) == pytest.approx(29.0)


def test_floor_is_the_lowest_tau_within_budget():
    model = AccuracyModel.from_eval(eval_rows())  # pooled loss: 0.9 -> 0, 0.8 -> 7.5, 0.7 -> 22.5 points
    grid = [t for t in TAU_GRID if t >= 0.5]
    assert model.floor(0.0, 1.0, grid) == 0.9
    assert model.floor(1.0, 1.0, grid) == 0.9
    assert model.floor(8.0, 1.0, grid) == 0.8
    assert model.floor(None, 1.0, grid) == 0.5


def test_a_step_that_changes_no_commit_is_free_and_one_that_does_costs_the_whole_loss():
    budget = QualityBudget(QualityConfig(AccuracyModel.from_eval(eval_rows()), max_accuracy_drop=None))
    r = Request("a", (2, 3), 64, 16, 0.0, 10.0, tau_max=0.9)
    sure = [0] * 20
    sure[19] = 16  # every masked position above 0.95: τ 0.7 commits what τ_max would
    assert budget.charge(r, 0.7, sure, 0.99) == 0.0 and r.predicted_loss == 0.0
    unsure = list(sure)
    unsure[15], unsure[19] = 3, 1  # three in [0.75, 0.8): committed at 0.7, not at 0.9
    assert budget.charge(r, 0.7, unsure, 0.97) == pytest.approx(budget.loss(r, 0.7))
    assert budget.charge(r, 0.7, unsure, 0.97) == 0.0  # the whole-request loss at 0.7 is charged once
    assert budget.charge(r, 0.6, (), None) == pytest.approx(budget.loss(r, 0.6) - budget.loss(r, 0.7))
    assert r.predicted_loss == pytest.approx(budget.loss(r, 0.6))  # no histogram: assumed changed


def test_changed_commits_leave_out_the_argmax():
    counts = [0] * 20
    counts[17] = 1  # one position in [0.85, 0.9), and it is the most confident: committed at 0.9 as well
    assert changed_commits(counts, 0.87, 0.85, 0.9) == 0
    counts[16] = 2
    assert changed_commits(counts, 0.87, 0.8, 0.9) == 2
    assert changed_commits(counts, 0.95, 0.8, 0.9) == 3


def test_first_step_evidence_separates_risky_from_confident():
    model = AccuracyModel.from_eval(eval_rows())
    assert model.prior(64) == pytest.approx((0.5, 0.5))
    safe, risky = model.posterior(64, SAFE_COUNTS), model.posterior(64, RISKY_COUNTS)
    assert safe[0] > 0.99 and risky[1] > 0.99
    budget = QualityBudget(QualityConfig(model))
    a, b = Request("a", (1,), 64, 16, 0.0, 1.0), Request("b", (2,), 64, 16, 0.0, 1.0)
    budget.set_evidence(a, SAFE_COUNTS)
    budget.set_evidence(b, RISKY_COUNTS)
    assert 0 < budget.loss(a, 0.6) < 1.0 < 50 < budget.loss(b, 0.6)  # never exactly free below the floor


# --- the budget in the controller ---

def test_budget_zero_keeps_every_request_at_or_above_the_floor(latency):
    free, _ = make(latency, None)
    burst(free)
    assert min(step_taus(free)) < 0.9  # without a bound this overload lowers τ
    engine, _ = make(latency, 0.0)
    burst(engine)
    assert min(step_taus(engine)) >= 0.9  # the budget-0 floor
    assert engine.scheduler.quality().predicted_loss_mean == 0.0


def stream(latency, budget, mode="adaptive", n=150, gap=0.02, check=None):
    """A random stream (Poisson arrivals, random SLOs and lengths, half safe, half risky); returns
    the results and the engine. `check(engine)` runs after every step."""
    engine, clock = make(latency, budget, mode)
    rng = np.random.default_rng(7)
    handles, t = [], 0.0
    for i in range(n):
        t += float(rng.exponential(gap))
        while clock() < t and engine.step_once():
            if check:
                check(engine)
        clock.advance(max(0.0, t - clock()))
        handles.append(engine.submit(req(f"q{i}", t, float(rng.uniform(0.03, 0.2)), answer=int(rng.choice([32, 64])),
                                         first_token=int(rng.integers(1, 3)))))
    engine.run_until_idle()
    return [h.result(0) for h in handles], engine


def test_mean_predicted_loss_stays_within_budget_over_a_long_random_stream(latency):
    budget = 2.0

    def running_mean_within_budget(engine):
        assert engine.scheduler.controller.budget.allowance() >= -1e-9

    results, engine = stream(latency, budget, check=running_mean_within_budget)
    snap = engine.scheduler.quality()
    assert snap.served == sum(r.state == RequestState.FINISHED_OK for r in results) == len(results)
    assert 0.0 < snap.predicted_loss_mean <= budget + 1e-9
    assert min(step_taus(engine)) < 0.9  # it did spend: some requests went below the fixed floor


@pytest.mark.slow
def test_spending_the_budget_on_evidence_does_not_lose_to_the_fixed_floor(latency):
    # Both judge feasibility at the τ the budget granted (the floor, or what it granted), so the
    # floor no longer over-admits: on this stream 137 of 150 against the floor's 136 (the floor met
    # 132 when feasibility was judged at τ_min), and the budget spends under half its allowance.
    floor, _ = stream(latency, 2.0, mode="floor")  # the fixed floor for 2 points is 0.9 here
    adaptive, engine = stream(latency, 2.0)
    assert 0.0 < engine.scheduler.quality().predicted_loss_mean <= 2.0
    assert sum(r.deadline_met for r in adaptive) >= sum(r.deadline_met for r in floor)


def test_risky_request_keeps_a_higher_tau_than_a_confident_one_under_the_same_slack(latency):
    sched = Scheduler(SchedulerConfig(4, threshold=ThresholdConfig.from_eval(eval_rows(), max_accuracy_drop=10.0)),
                      latency)
    ctrl = sched.controller
    a, b = req("confident", 0.0, 1.0, first_token=1), req("risky", 0.0, 1.0, first_token=2)
    a.evidence, b.evidence = SAFE_COUNTS, RISKY_COUNTS
    need = max(ctrl.remaining_time(r, 0.6, 2, sched.step_time) for r in (a, b))
    a.deadline = b.deadline = 1.05 * need  # both need τ ≈ 0.6 to make it
    assert ctrl.remaining_time(a, 0.9, 2, sched.step_time) > a.deadline
    plan = ctrl.plan([a, b], [], 0.0, 4, sched.step_time)
    assert plan["confident"].tau < 0.9 <= plan["risky"].tau
    assert not plan["confident"].at_risk and plan["risky"].at_risk


def test_budget_never_overrides_tau_min(latency):
    for budget, mode in ((None, "adaptive"), (100.0, "adaptive"), (100.0, "floor")):
        engine, _ = make(latency, budget, mode)
        results = burst(engine, tau_min=0.8)
        assert min(step_taus(engine)) >= 0.8, (budget, mode)
        assert all(r.state == RequestState.FINISHED_OK for r in results)


def test_fixed_floor_mode_holds_everyone_at_the_floor(latency):
    engine, _ = make(latency, 8.0, mode="floor")  # pooled loss 7.5 points at 0.8
    burst(engine)
    assert min(step_taus(engine)) == pytest.approx(0.8)


def test_a_request_with_its_own_bound_is_held_to_it(latency):
    engine, _ = make(latency, 50.0)  # the pool could afford a lot
    strict = [req(f"s{i}", 0.0, 0.13 + 0.004 * i, first_token=1) for i in range(6)]
    loose = [req(f"l{i}", 0.0, 0.13 + 0.004 * i, first_token=1) for i in range(6)]
    for r in strict:
        r.max_accuracy_drop = 0.0
    for r in strict + loose:
        engine.submit(r)
    engine.run_until_idle()
    assert all(s.tau >= 0.9 for r in strict for s in r.steps)
    assert all(r.predicted_loss == 0.0 for r in strict)
    assert min(s.tau for r in loose for s in r.steps) < 0.9


def test_request_validates_its_bound():
    with pytest.raises(ValueError, match="max_accuracy_drop"):
        Request("a", (1,), 16, 16, 0.0, 1.0, max_accuracy_drop=-1.0)


def test_a_published_table_without_tasks_gives_a_pooled_model(latency):
    # e.g. a paper's τ -> accuracy table: summary rows only, no per-task profiles, no signatures
    table = [{"task": "mean:all", "kind": "summary", "threshold": t, "accuracy": a, "tokens_per_step": r,
              "steps": 64 / r, "n": 100} for t, a, r in ((1.0, 0.80, 1.0), (0.9, 0.80, 2.0), (0.7, 0.78, 3.2),
                                                          (0.5, 0.70, 4.7))]
    model = AccuracyModel.from_eval(table)
    assert model.profiles == () and model.loss(0.7, 1.0) == pytest.approx(2.0)
    budget = QualityBudget(QualityConfig(model, max_accuracy_drop=1.0))
    r = Request("a", (1,), 64, 16, 0.0, 1.0)
    assert budget.loss(r, 0.7) == pytest.approx(2.0) and budget.cost(r, 0.9) == 0.0
    clock = FakeClock()
    sched = Scheduler(SchedulerConfig(4, threshold=ThresholdConfig.from_eval(table, max_accuracy_drop=5.0)), latency)
    engine = Engine(FakeRunner(4, clock), sched, clock)
    results = burst(engine, n=16)
    assert all(res.state == RequestState.FINISHED_OK for res in results)
    assert 0.0 < sched.quality().predicted_loss_mean <= 5.0 + 1e-9  # spent, within the bound


def test_the_pool_keeps_the_scatter_of_the_measured_drop_within_the_budget():
    model = AccuracyModel.from_eval(eval_rows())
    reqs = [Request(f"r{i}", (1,), 64, 16, 0.0, 1.0, tau_max=0.9) for i in range(50)]
    gamble = reqs[0]  # no evidence yet: 50/50 between a safe and a risky profile
    for z, granted in ((0.0, True), (1.64, False)):
        budget = QualityBudget(QualityConfig(model, max_accuracy_drop=1.0, confidence_z=z))
        for r in reqs:
            budget.join(r)
        cost = budget.cost(gamble, 0.7)
        assert 20 < cost < 50  # the mean alone (50 requests x 1 point of allowance) covers it...
        floors = budget.grant([gamble], {gamble.id: 0.7}, {}, {gamble.id: [0.9, 0.8, 0.7]})
        assert (floors[gamble.id] == 0.7) is granted  # ...its scatter (a coin flip on one answer in 50) does not
    small = Request("s", (1,), 64, 16, 0.0, 1.0, tau_max=0.9)
    budget.set_evidence(small, SAFE_COUNTS)  # identified as safe: a small, well-understood spend
    budget.join(small)
    assert budget.grant([small], {"s": 0.7}, {}, {"s": [0.9, 0.8, 0.7]})["s"] == 0.7


def _summary_rows(points, n):
    return [{"task": "mean:all", "kind": "summary", "threshold": t, "accuracy": a, "tokens_per_step": 1 / t,
             "steps": 64 * t, "n": n} for t, a in points]


def test_the_default_ceiling_is_the_accuracy_plateau_of_the_shipped_rows():
    plateau = AccuracyModel.from_eval(Path(__file__).parents[2] / "dilaserve_jax/assets/tiny/eval.json").plateau()
    assert plateau.tau == 0.9 and plateau.best_tau == 1.0  # 96.5% at 0.9 against 97.25% at 1.0, n = 400 each
    assert "95% interval" in plateau.describe()


def test_the_published_llada_table_has_its_plateau_at_0_9():
    # Fast-dLLM's LLaDA-8B GSM8K figures (the two published points, n = the 1,319 test problems)
    assert AccuracyModel.from_eval(_summary_rows([(1.0, 0.793), (0.9, 0.792)], 1319)).plateau().tau == 0.9


def test_rows_without_a_plateau_keep_the_ceiling_at_the_best_tau():
    steep = _summary_rows([(1.0, 0.97), (0.9, 0.90), (0.8, 0.80), (0.7, 0.70)], 400)
    assert AccuracyModel.from_eval(steep).plateau().tau == 1.0
    # a plateau that ends: the walk down stops at the first τ told apart from the best
    ends = _summary_rows([(1.0, 0.95), (0.9, 0.95), (0.8, 0.94), (0.7, 0.80), (0.6, 0.95)], 400)
    assert AccuracyModel.from_eval(ends).plateau().tau == 0.8
    # the fewer problems behind each figure, the wider the plateau
    few = _summary_rows([(1.0, 0.97), (0.9, 0.90), (0.8, 0.80)], 20)
    assert AccuracyModel.from_eval(few).plateau().tau == 0.8


def test_the_budget_reference_stays_fixed_when_a_request_raises_its_own_tau_max():
    model = AccuracyModel.from_eval(eval_rows())
    budget = QualityBudget(QualityConfig(model, max_accuracy_drop=1.0, reference_tau=0.9, mode="floor"))
    at_ceiling, asks_more = Request("a", (1,), 64, 16, 0.0, 1.0, tau_max=0.9), Request("b", (1,), 64, 16, 0.0, 1.0)
    assert budget.reference(at_ceiling) == budget.reference(asks_more) == 0.9
    assert budget.loss(asks_more, 0.7) == budget.loss(at_ceiling, 0.7) == pytest.approx(model.loss(0.7, 0.9))
    assert budget.loss(asks_more, 0.95) == 0.0  # above the reference: latency, no loss and no gain
    own_lower = Request("c", (1,), 64, 16, 0.0, 1.0, tau_max=0.7)
    assert budget.reference(own_lower) == 0.7 and budget.loss(own_lower, 0.7) == 0.0  # its own choice
    free = QualityBudget(QualityConfig(model, max_accuracy_drop=1.0, mode="floor"))  # no reference: its own τ_max
    assert free.loss(asks_more, 0.9) == pytest.approx(model.loss(0.9, 1.0))


def test_free_floor_is_the_lowest_tau_the_budget_grants_from_the_reference():
    """What the cluster controller prices layouts at: on the shipped eval rows, a 1-point budget
    from τ 0.9 holds thresholds at 0.9 (τ 0.85 already costs ~5 points), 10 points allow 0.85, an
    unbounded budget τ_min."""
    path = Path(__file__).parents[2] / "dilaserve_jax" / "assets" / "tiny" / "eval.json"
    rows = read_eval_rows(path)
    floor = lambda drop: QualityConfig.from_eval(rows, max_accuracy_drop=drop, reference_tau=0.9).free_floor(  # noqa: E731
        0.5, 0.9, TAU_GRID)
    assert floor(1.0) == 0.9
    assert floor(10.0) == 0.85
    assert floor(None) == 0.5
    assert QualityConfig.from_eval(rows, max_accuracy_drop=None).free_floor(0.6, 0.9, TAU_GRID) == 0.6  # never below τ_min


def test_feasibility_is_judged_at_the_lowest_tau_the_budget_allows():
    """A request the budget holds at 0.9 does not finish at τ_min's speed: judged at 0.5 it would look
    feasible, join a larger batch or take a slot, and miss."""
    from dilaserve_jax.serving.policy.threshold import ThresholdController

    def step_time(kind, batch, r):
        return 0.01 * batch

    held = ThresholdController(ThresholdConfig.from_eval(eval_rows(), max_accuracy_drop=0))
    free = ThresholdController(ThresholdConfig.with_prior(dict(held.cfg.prior)))
    r = req("r", 0.0, 1.0, first_token=2, tau_min=0.5, tau_max=0.9)
    at_min, at_ceiling = (free.remaining_time(r, t, 1, step_time) for t in (0.5, 0.9))
    assert at_min < at_ceiling
    r.deadline = (at_min + at_ceiling) / 2
    assert held.lowest_tau(r) == 0.5  # nothing granted yet
    for ctl in (held, free):
        ctl.plan([], [r], 0.0, 1, step_time)
    assert held.lowest_tau(r) == 0.9 and free.lowest_tau(r) == 0.5
    assert free.feasible_at(r, 0.0, 1, step_time) and not held.feasible_at(r, 0.0, 1, step_time)


def _pressure_run(share, hopeless_every):
    """One request a second for 20 s (every `hopeless_every`-th past saving on arrival, the rest with
    a minute of slack); returns the controller and the τ planned for the last request in time."""
    from dilaserve_jax.serving.policy.threshold import ThresholdController
    table = [{"task": "mean:all", "kind": "summary", "threshold": t, "accuracy": a, "tokens_per_step": r,
              "steps": 64 / r, "n": 1000} for t, a, r in ((1.0, 0.80, 1.0), (0.9, 0.80, 2.0), (0.7, 0.798, 3.2),
                                                           (0.5, 0.77, 4.7))]
    quality = QualityConfig(AccuracyModel.from_eval(table), max_accuracy_drop=1.0, confidence_z=0.0,
                            reference_tau=0.9)
    ctl = ThresholdController(ThresholdConfig.with_prior({1.0: 1.0, 0.9: 2.0, 0.7: 3.2, 0.5: 4.7}, quality=quality,
                                                         pressure_at_risk_share=share))
    tau = None
    for t in range(20):
        hopeless = hopeless_every and t % hopeless_every == 0
        r = req(f"r{t}", float(t), 1e-3 if hopeless else 60.0, tau_min=0.5, tau_max=0.9)
        plan = ctl.plan([], [r], float(t), 4, lambda kind, batch, r: 0.01 * batch)
        assert plan[r.id].at_risk == bool(hopeless)
        if not hopeless:
            tau = plan[r.id].tau
        ctl.forget(r.id, served_loss=r.predicted_loss)
    return ctl, tau


def test_arrival_pressure_spends_the_spare_budget_on_speed_only_while_deadlines_are_lost():
    """With a fifth of the arrivals lost, a request in time with a minute of slack runs at the budget's
    floor (0.7: 0.2 points of its 1) instead of the free 0.9 its deadline alone asks for; with none lost,
    or the rule off, it stays at 0.9."""
    ctl, tau = _pressure_run(0.05, hopeless_every=5)
    assert ctl.pressure and tau == 0.7
    assert ctl.quality_snapshot().pressure
    ctl, tau = _pressure_run(0.05, hopeless_every=0)
    assert not ctl.pressure and tau == 0.9
    ctl, tau = _pressure_run(None, hopeless_every=5)
    assert not ctl.pressure and tau == 0.9
