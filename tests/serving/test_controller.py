"""The cluster controller's policy on a virtual clock (no JAX, no runner): it follows the load in
both directions, does not flap, moves at-risk requests, and decides fast at 64 devices."""
import time

import numpy as np
import pytest

from dilaserve_jax.core.layouts import (binary_partitions, every_placement, layout_text, moved_fraction, parse_layout,
                                        placements)
from dilaserve_jax.serving.policy.bursts import burst_spread
from dilaserve_jax.serving.policy.capacity import RequestShape
from dilaserve_jax.serving.policy.layout_eval import LayoutPrediction
from dilaserve_jax.serving.policy.controller import AtRisk, ClusterController, ControllerConfig
from dilaserve_jax.serving.cluster.fake_runner import fake_tp_profile
from dilaserve_jax.serving.policy.latency import LatencyModel
from dilaserve_jax.serving.policy.refinement import Refinement

SHAPE = RequestShape(prompt_len=32, answer_len=64, block_len=16, slo_s=0.4)


@pytest.fixture(scope="module")
def tp_latency():
    return LatencyModel.from_profile(fake_tp_profile((1, 2, 4, 8)))


def make(tp_latency, devices=8, **cfg):
    kw = dict(interval_s=1.0, window_s=10.0, min_dwell_s=5.0, confirmations=2)
    kw.update(cfg)
    return ClusterController(ControllerConfig(**kw), num_devices=devices, tp_degrees=(1, 2, 4, 8),
                             latency=tp_latency, slots=8, param_bytes=10**7)


def drive(ctl, layout, rates, seconds_each=20.0, start=0.0):
    """Arrivals at each rate in turn (evenly spaced), a decision every interval; applies switches.
    Returns the layouts after each phase and the number of switches."""
    now, lay, seen, switches = start, tuple(layout), [], 0
    for rate in rates:
        end = now + seconds_each
        next_arrival = now
        while now < end:
            while next_arrival <= now:
                ctl.observe(SHAPE, next_arrival)
                next_arrival += 1.0 / rate
            d = ctl.decide(now, lay)
            if d.switch:
                lay = parse_layout(d.chosen)
                ctl.switched(now)
                switches += 1
            now += ctl.cfg.interval_s
        seen.append(layout_text(lay))
    return seen, switches, lay


def test_a_load_ramp_moves_towards_more_instances_and_back(tp_latency):
    ctl = make(tp_latency)
    low, high = 2.0, 400.0
    seen, switches, lay = drive(ctl, (8,), [low, high, low])
    assert seen[0] == "1x8"  # light load: the widest instance finishes each request soonest
    assert len(parse_layout(seen[1])) > 1  # heavy load: more, narrower instances
    assert seen[2] == "1x8"  # back when the load drops
    assert switches >= 2
    switched = [d for d in ctl.history if d.switch]
    assert all(d.predicted[d.chosen][0] >= d.predicted[d.current][0] - 1e-9 for d in switched)
    ranked = [d for d in ctl.history if d.predicted]
    # every decision with predictions carries the current layout and the top three candidates
    assert ranked and all(d.current in d.predicted and len(d.predicted) >= min(3, len(ctl.candidates))
                          for d in ranked)
    assert all(list(d.predicted)[0] == d.chosen for d in ranked)  # best first
    assert all(d.reason for d in ctl.history)


def test_a_load_oscillating_around_the_switch_point_does_not_flap(tp_latency):
    # 60 and 110 req/s lie either side of where 2x4 starts to beat 1x8 by a small margin; each phase
    # outlasts the rate window, so an undamped controller follows every swing
    undamped = make(tp_latency, min_dwell_s=0.0, confirmations=1, hysteresis=0.0)
    _, flaps, _ = drive(undamped, (8,), [60.0, 110.0] * 6, seconds_each=20.0)
    assert flaps >= 6  # the load really does pull both ways
    ctl = make(tp_latency, min_dwell_s=30.0)
    _, switches, _ = drive(ctl, (8,), [60.0, 110.0] * 6, seconds_each=20.0)
    assert switches <= 1, [str(d) for d in ctl.history if d.switch]


def test_a_jump_to_a_new_level_is_followed_before_the_window_catches_up(tp_latency):
    def first_switch(**cfg):
        ctl = make(tp_latency, min_dwell_s=0.0, **cfg)
        drive(ctl, (8,), [2.0, 400.0], seconds_each=20.0)
        d = next(d for d in ctl.history if d.switch)
        return d.time, d.rate, d.chosen

    (early, rate, chosen), (late, _, settled) = first_switch(), first_switch(level_shift_gain=None)
    # half a window (5 s) at the new level, then the confirmations; without the rule the window's
    # rate must come within the settle tolerance of it first
    assert early <= 20.0 + 5.0 + 2 * 1.0 + 1e-9 < late
    # priced at the new level (the last half-window, within the settle tolerance of 400), not the
    # window's mix (under 250 req/s then), and to the layout chosen once the window has settled
    assert 400.0 * 0.75 <= rate <= 400.0 * 1.05 and chosen == settled


def test_no_switch_before_one_full_window_of_arrivals(tp_latency):
    ctl = make(tp_latency, window_s=10.0, min_dwell_s=0.0)
    _, switches, _ = drive(ctl, (8,), [400.0], seconds_each=9.0)  # heavy from the start, under one window
    assert switches == 0
    assert any("not trusted yet" in d.reason for d in ctl.history)
    _, switches, lay = drive(ctl, (8,), [400.0], seconds_each=6.0, start=9.0)  # the window fills: it acts
    assert switches == 1 and len(lay) > 1


def test_hysteresis_and_confirmation_hold_a_single_spike(tp_latency):
    ctl = make(tp_latency, confirmations=3)
    _, switches, lay = drive(ctl, (8,), [2.0, 400.0, 2.0], seconds_each=2.0)  # 2 rounds of spike < 3
    assert switches == 0 and lay == (8,)


def test_at_risk_requests_go_to_an_idle_instance(tp_latency):
    ctl = make(tp_latency)
    risky = AtRisk("late", deadline=10.0, remaining_s=0.5, running=True, moves=0, last_move=None)
    hopeless = AtRisk("gone", deadline=9.2, remaining_s=0.5, running=False, moves=0, last_move=None)
    moves = ctl.plan_migrations(9.0, {"tp4@0-3": [(risky, "tp4@4-7"), (hopeless, "tp4@4-7")]})
    assert [(m.request_id, m.source, m.target) for m in moves] == [("late", "tp4@0-3", "tp4@4-7")]
    assert ctl.plan_migrations(9.5, {"tp4@0-3": [(risky, "tp4@4-7")]}) == []  # cooldown


def test_decision_time_for_64_devices(tp_latency):
    # the costliest pricing: answers ending early and their latency priced apart (two chains per TP degree)
    ctl = ClusterController(ControllerConfig(latency_at_answer_ends=True), num_devices=64, tp_degrees=(1, 2, 4, 8),
                            latency=tp_latency, slots=8, param_bytes=10**9)
    ctl.set_last_block_fill(0.5)
    for i in range(64):
        ctl.observe(SHAPE, i * 0.1)
    t0 = time.perf_counter()
    d = ctl.decide(6.4, (8,) * 8)
    assert time.perf_counter() - t0 < 1.0 and d.seconds < 1.0
    assert len(ctl.candidates) == len(binary_partitions(64, (1, 2, 4, 8))) > 500


def test_candidates_costs_and_layout_text():
    assert len(binary_partitions(8, (1, 2, 4, 8))) == 10
    assert parse_layout("4+2+1+1") == (4, 2, 1, 1) and layout_text((1, 1, 2, 4)) == "4+2+1+1"
    assert placements((1, 4, 2, 1)) == [(4, 0), (2, 4), (1, 6), (1, 7)]
    assert moved_fraction((4, 4), (4, 4)) == 0
    assert moved_fraction((8,), (4, 4)) == pytest.approx(1.75)  # each device keeps 1/8, needs 1/4
    assert moved_fraction((4, 4), (8,)) == pytest.approx(0.75)
    with pytest.raises(ValueError):
        parse_layout("3x3")


def test_a_switch_pays_a_build_per_new_instance_and_a_compile_per_placement_not_in_hand(tp_latency):
    ctl = make(tp_latency, compile_s=10.0, load_s=1.0)
    shape = [RequestShape(prompt_len=32, answer_len=64, block_len=16, slo_s=0.4)]
    move = moved_fraction((4, 4), (1,) * 8) * 10**7 / 100e9
    assert ctl.switch_seconds((4, 4), (1,) * 8, shape)[0] == pytest.approx(move + 8 * (1.0 + 10.0))
    in_hand = every_placement({1}, 8)  # e.g. a GPU compile cache that already holds TP 1
    assert ctl.switch_seconds((4, 4), (1,) * 8, shape, in_hand)[0] == pytest.approx(move + 8 * 1.0)
    # an instance both layouts run is kept: neither built nor compiled
    assert ctl.switch_seconds((4, 2, 1, 1), (4, 1, 1, 1, 1), shape, frozenset())[0] == pytest.approx(
        moved_fraction((4, 2, 1, 1), (4, 1, 1, 1, 1)) * 10**7 / 4 / 100e9 + 2 * 11.0)  # bytes / widest TP
    assert every_placement({2, 8}, 8) == {(2, 0), (2, 2), (2, 4), (2, 6), (8, 0)}


def test_layout_restriction_and_missing_fits_are_errors(tp_latency):
    ctl = ClusterController(ControllerConfig(), num_devices=8, tp_degrees=(1, 2, 4, 8), latency=tp_latency,
                            slots=8, param_bytes=1, layouts=["2x4", "8x1"])
    assert [layout_text(c) for c in ctl.candidates] == ["2x4", "8x1"]
    with pytest.raises(ValueError, match="do not cover"):
        ClusterController(ControllerConfig(), num_devices=8, tp_degrees=(1, 2, 4, 8), latency=tp_latency, slots=8,
                          param_bytes=1, layouts=["2x2"])
    one_tp = LatencyModel.from_profile(fake_tp_profile((1,)))
    with pytest.raises(ValueError, match="no fit for TP"):
        ClusterController(ControllerConfig(), num_devices=8, tp_degrees=(1, 2), latency=one_tp, slots=8, param_bytes=1)


def test_the_sample_is_the_windows_quantiles_of_work(tp_latency):
    from dataclasses import replace
    ctl = make(tp_latency, window_s=10.0, sample_size=4)
    order = np.random.default_rng(0).permutation(100)
    for i, k in enumerate(order):  # 10 req/s for 10 s, prompt lengths 10..109 in random order
        ctl.observe(replace(SHAPE, prompt_len=10 + int(k)), i * 0.1)
    rate, sample = ctl.load(10.0)
    assert rate == pytest.approx(10.0)
    assert [s.prompt_len for s in sample] == [22, 47, 72, 97]  # the quartiles' midpoints, not arrival order


def test_the_sample_holds_a_heavy_tailed_windows_mean_work(tp_latency):
    from dataclasses import replace
    errors = []
    for seed in range(10):  # ten windows of 3,000 arrivals with answers of 1..16 blocks, heavy in the tail
        blocks = np.minimum(np.random.default_rng(seed).geometric(0.45, size=3000), 16)
        ctl = make(tp_latency, window_s=30.0, sample_size=256)
        for i, b in enumerate(blocks):
            ctl.observe(replace(SHAPE, answer_len=16 * int(b)), i * 0.01)
        _, sample = ctl.load(30.0)
        assert len(sample) == 256
        errors.append(np.mean([s.answer_len // s.block_len for s in sample]) / blocks.mean() - 1)
    # a sample of 256 spread in arrival order misses the mean by ~5% (one standard error) window to window
    assert max(abs(e) for e in errors) < 0.01


def test_the_tokens_per_step_estimate_is_smoothed_over_rounds(tp_latency):
    ctl = make(tp_latency)
    before, a = ctl.tokens_per_step, ctl.cfg.tokens_per_step_smoothing
    ctl.set_tokens_per_step(ctl.taus, [2 * r for r in before])
    assert ctl.tokens_per_step == pytest.approx([r * (1 + a) for r in before])


def test_a_rise_within_the_window_is_priced_at_its_last_half(tp_latency):
    ctl = make(tp_latency, window_s=10.0, level_shift_gain=None)
    t = 0.0
    while t < 20.0:
        ctl.observe(SHAPE, t)
        t += 0.1
    while t < 23.0:
        ctl.observe(SHAPE, t)
        t += 0.025
    d = ctl.decide(23.0, (8,))
    # the window holds 7 s at 10 and 3 s at 40 req/s (19 on average); its last 5 s, 28
    assert d.rate == pytest.approx(28.0, rel=0.05)


def _scripted(tp_latency, rounds):
    """A controller whose predictions follow a script, one {layout: attainment} per round (the
    current layout 1x8 at 0.5), over a steady 10 req/s; returns its decisions."""
    ctl = make(tp_latency, window_s=10.0, min_dwell_s=0.0)
    for i in range(200):
        ctl.observe(SHAPE, i * 0.1)
    script = iter(rounds)

    def predict(rate, sample, layouts=None, curves=None, spread=None):
        atts = {(8,): 0.5, **next(script)}
        return [LayoutPrediction(lay, a, 0.1, 0.9) for lay, a in atts.items()]

    ctl.predict = predict
    return [ctl.decide(20.0 + 0.1 * k, (8,)) for k in range(len(rounds))]


def test_a_switch_needs_rounds_in_a_row_won_by_the_margin(tp_latency):
    # 2x4 wins every round, but by the margin only every other round: noise, not a better layout
    flicker = [{(4, 4): 0.7 if k % 2 == 0 else 0.505} for k in range(6)]
    assert not any(d.switch for d in _scripted(tp_latency, flicker))
    steady = [{(4, 4): 0.7}] * 2
    assert [d.switch for d in _scripted(tp_latency, steady)] == [False, True]


def test_near_equal_candidates_trading_first_place_still_confirm_a_switch(tp_latency):
    # 2x4 and 4x2 both beat 1x8 by far and trade first place by less than the hysteresis
    trading = [{(4, 4): 0.70, (2, 2, 2, 2): 0.705}, {(4, 4): 0.705, (2, 2, 2, 2): 0.70}]
    decisions = _scripted(tp_latency, trading)
    assert decisions[-1].switch and decisions[-1].chosen == "4x2"  # the one the streak began with


def test_answers_that_end_early_in_their_last_block_are_predicted_faster(tp_latency):
    # with price_answer_ends everything is priced at the share, with latency_at_answer_ends the latency
    ctl = make(tp_latency, price_answer_ends=True)
    layouts = [(2, 2, 2, 2), (8,)]
    full = ctl.predict(20.0, [SHAPE] * 4, layouts)
    ctl.set_last_block_fill(0.25)
    short = ctl.predict(20.0, [SHAPE] * 4, layouts)
    assert all(s.latency_s < f.latency_s for s, f in zip(short, full))
    off = make(tp_latency)  # the default prices the whole area whatever the instances report
    off.set_last_block_fill(0.25)
    assert off.predict(20.0, [SHAPE] * 4, layouts) == full
    latency = make(tp_latency, latency_at_answer_ends=True)  # deadlines and τ at the whole area
    latency.set_last_block_fill(0.25)
    mixed = latency.predict(20.0, [SHAPE] * 4, layouts)
    assert [(m.attainment, m.tau) for m in mixed] == [(f.attainment, f.tau) for f in full]
    assert all(m.latency_s < f.latency_s for m, f in zip(mixed, full))
    assert [m.latency_s for m in mixed] == pytest.approx([s.latency_s for s in short], rel=0.05)
    with pytest.raises(ValueError, match="fill"):
        ctl.set_last_block_fill(0.0)


def test_the_latency_margin_reads_latency_past_the_load_and_leaves_attainment_and_tau(tp_latency):
    layouts = [(2, 2, 2, 2), (4, 4), (8,)]
    sample = [SHAPE] * 4
    plain = make(tp_latency).predict(20.0, sample, layouts)
    ctl = make(tp_latency, latency_rate_margin=0.25)
    margin = ctl.predict(20.0, sample, layouts)
    past = make(tp_latency).predict(25.0, sample, layouts)
    assert [(m.attainment, m.tau) for m in margin] == [(p.attainment, p.tau) for p in plain]
    assert [m.latency_s for m in margin] == [p.latency_s for p in past]
    assert any(m.latency_s > p.latency_s for m, p in zip(margin, plain))  # a loaded layout slows past its load
    assert ctl.predict(0.0, sample, layouts) == make(tp_latency).predict(0.0, sample, layouts)
    with pytest.raises(ValueError, match="margin"):
        ControllerConfig(latency_rate_margin=-0.1)


def test_late_wait_rounds_reach_the_chain_and_price_only_latency(tp_latency):
    """`late_wait_rounds` prices a late request as waiting for the requests in time (capacity.py): at
    a load where layouts miss, their predicted latency grows and attainment and τ stay; off (0) by
    default, and no negative count."""
    layouts = [(2, 2, 2, 2), (4, 4), (8,)]
    sample = [SHAPE, RequestShape(prompt_len=32, answer_len=64, block_len=16, slo_s=0.05)] * 2
    plain = make(tp_latency).predict(30.0, sample, layouts)
    waits = make(tp_latency, late_wait_rounds=128).predict(30.0, sample, layouts)
    assert ControllerConfig().late_wait_rounds == 0
    assert [(w.attainment, w.tau) for w in waits] == [(p.attainment, p.tau) for p in plain]
    assert all(p.attainment < 1 for p in plain)
    assert all(w.latency_s > p.latency_s for w, p in zip(waits, plain))
    with pytest.raises(ValueError, match="late wait"):
        ControllerConfig(late_wait_rounds=-1)


def _steady(ctl, rate, seconds, realised, layout=(8,), realised_latency=lambda layout: None):
    """Arrivals at `rate` for `seconds`, each round told the current layout realised `realised`
    and `realised_latency(layout)`."""
    now, lay, next_arrival = 0.0, tuple(layout), 0.0
    while now < seconds:
        while next_arrival <= now:
            ctl.observe(SHAPE, next_arrival)
            next_arrival += 1.0 / rate
        d = ctl.decide(now, lay, realised=realised, realised_latency=realised_latency(lay))
        if d.switch:
            lay = parse_layout(d.chosen)
            ctl.switched(now)
        now += ctl.cfg.interval_s
    return lay


def test_a_layout_realising_far_less_than_predicted_is_priced_at_a_heavier_load(tp_latency):
    # at 60 req/s one TP-8 instance is predicted best and to meet nearly every deadline
    kept = make(tp_latency, feedback_min_requests=50)
    assert _steady(kept, 60.0, 30.0, realised=(99, 100)) == (8,)
    settled = [d for d in kept.history if d.time >= kept.cfg.window_s]  # (a full window of arrivals)
    assert settled and all(d.rate == pytest.approx(60.0, rel=0.1) and d.realised is not None for d in settled)
    assert kept.history[-1].realised == pytest.approx(0.99)
    # told it realised a fifth of them, it prices every layout at the rate where its own prediction
    # falls that low, and moves to more, narrower instances
    ctl = make(tp_latency, feedback_min_requests=50)
    assert len(_steady(ctl, 60.0, 30.0, realised=(20, 100))) > 1
    checked = [d for d in ctl.history if "priced at" in d.reason and d.time >= ctl.cfg.window_s]
    assert checked and all(60.0 * 1.05 < d.rate <= 60.0 * ctl.cfg.feedback_max_scale * 1.05 for d in checked)
    first = checked[0]
    assert ctl.predict(first.rate, [SHAPE], [(8,)])[0].attainment <= 0.2 + 0.01 \
        or first.rate == pytest.approx(60.0 * ctl.cfg.feedback_max_scale, rel=0.1)
    # too few requests to judge by, or feedback off (the default): the arrival rate alone, and what
    # the layout realised is still recorded
    for few in (make(tp_latency, feedback_min_requests=50), make(tp_latency)):
        assert _steady(few, 60.0, 30.0, realised=(2, 10) if few.cfg.feedback_min_requests else (20, 100)) == (8,)
        assert not any("priced at" in d.reason for d in few.history)
        assert few.history[-1].realised == pytest.approx(0.2) and "realised 20.0%" in str(few.history[-1])


def test_a_layout_slower_than_predicted_is_left_and_not_chosen_again_at_that_load(tp_latency):
    # at 10 req/s every layout meets the deadlines and one TP-8 instance is predicted fastest
    rate, sample = 10.0, [SHAPE] * 4
    predicted = {p.layout: p.latency_s for p in make(tp_latency).predict(rate, sample)}
    assert min(predicted, key=predicted.get) == (8,)
    as_predicted = make(tp_latency)
    assert _steady(as_predicted, rate, 60.0, None, realised_latency=lambda lay: (predicted[lay], 100)) == (8,)
    assert "latency x1.00 as realised" in as_predicted.history[-1].reason
    # told it runs five times slower than predicted, it leaves for the layout predicted next best and
    # stays there (it runs as predicted) while the load holds: the memory keeps TP 8 at x4, the cap
    slow = make(tp_latency)
    realised = lambda lay: (predicted[lay] * (5.0 if lay == (8,) else 1.0), 100)  # noqa: E731
    left = _steady(slow, rate, 60.0, None, realised_latency=realised)
    assert left != (8,) and slow.latency_memory.get((8,), rate, 60.0).ratio == pytest.approx(4.0)  # (capped)
    assert len(slow.history) == 60 and sum(d.switch for d in slow.history) == 1
    # off: the chain's figures alone
    assert _steady(make(tp_latency, latency_feedback_requests=0), rate, 60.0, None, realised_latency=realised) == (8,)


def test_latency_is_measured_on_steady_windows_only(tp_latency):
    bursty, steady = make(tp_latency), make(tp_latency)
    for k in range(6):  # 10 req/s on average: each 5 s's arrivals all within its first half second
        for i in range(50):
            bursty.observe(SHAPE, k * 5.0 + i / 100.0)
    for i in range(300):
        steady.observe(SHAPE, i / 10.0)
    now = 30.0
    assert bursty.spread(now, bursty.load(now)[1]) is not None and steady.spread(now, steady.load(now)[1]) is None
    for ctl in (bursty, steady):
        ctl.decide(now, (8,), realised_latency=(5.0, 100))
    assert not bursty.latency_memory.measured and "as realised" not in bursty.history[-1].reason
    assert steady.latency_memory.get((8,), 10.0, now) is not None and "as realised" in steady.history[-1].reason


def test_no_switch_gives_up_predicted_attainment_beyond_the_tolerance_for_speed(tp_latency, monkeypatch):
    # hand-built predictions: 4x2 wins the objective on speed with a point fewer deadlines met;
    # 2x4 meets as many as the current 1x8 and is faster
    fixed = {(8,): LayoutPrediction((8,), 0.95, 1.0, 0.8), (4, 4): LayoutPrediction((4, 4), 0.94, 0.5, 0.6),
             (2, 2, 2, 2): LayoutPrediction((2, 2, 2, 2), 0.95, 0.8, 0.8)}

    def predict(self, rate, sample, layouts=None, curves=None, spread=None):
        return [fixed.get(tuple(lay), LayoutPrediction(tuple(lay), 0.5, 5.0, 0.6)) for lay in layouts]

    monkeypatch.setattr(ClusterController, "predict", predict)
    cfg = ControllerConfig()
    value = {lay: cfg.value(p.attainment, p.tau, p.latency_s, 1.0) for lay, p in fixed.items()}
    assert max(value, key=value.get) == (4, 4)
    assert _steady(make(tp_latency), 20.0, 30.0, None) == (2, 2, 2, 2)
    ctl = make(tp_latency, switch_attainment_tolerance=float("inf"))  # the objective alone
    assert _steady(ctl, 20.0, 30.0, None) == (4, 4)
    assert "4x2" in ctl.history[0].predicted  # the record keeps the objective's top three either way
    # past its capacity (a backlog priced) the current layout's attainment misses what the backlog
    # costs, and speed decides
    fixed[(8,)] = LayoutPrediction((8,), 0.95, 1.0, 0.8, backlog_s=0.5)
    assert _steady(make(tp_latency), 20.0, 30.0, None) == (4, 4)
    with pytest.raises(ValueError, match="tolerance"):
        ControllerConfig(switch_attainment_tolerance=-0.01)


def test_poisson_arrivals_have_no_spread_and_bursts_are_priced_at_their_rate():
    rng = np.random.default_rng(0)
    poisson = np.cumsum(rng.exponential(1 / 50.0, 1500))
    poisson = poisson[poisson < 30.0]
    assert burst_spread(poisson, 0.0, 30.0, 2.0) is None  # within Poisson noise: the mean rate as before
    # the same number of arrivals, all in the first second of every 6
    bursts = np.concatenate([k * 6.0 + rng.uniform(0, 1.0, len(poisson) // 5) for k in range(5)])
    spread = burst_spread(bursts, 0.0, 30.0, 2.0)
    assert spread is not None and sum(w for _, w in spread) == pytest.approx(1.0)
    # every arrival came in a bin that held 3 times the mean (one busy bin in three): nearly all of
    # that excess is beyond the noise and kept
    mean_mult = sum(m * w for m, w in spread)
    assert 2.5 < mean_mult <= 3.0 + 1e-9
    assert burst_spread(bursts, 0.0, 30.0, 2.0, levels=3) is not None
    assert len(burst_spread(bursts, 0.0, 30.0, 2.0, levels=3)) <= 3
    assert burst_spread(bursts[:10], 0.0, 30.0, 2.0) is None  # too few arrivals to judge


def test_a_bursty_window_is_predicted_below_a_steady_one_at_the_same_mean_rate(tp_latency):
    def window(ctl, times):
        for t in times:
            ctl.observe(SHAPE, float(t))
        now = 10.0
        rate, sample = ctl.load(now)
        return {p.layout: p for p in ctl.predict(rate, sample, [(8,), (1,) * 8], spread=ctl.spread(now, sample))}

    # 240 req/s over the 10 s window: one TP-8 instance holds it, not twice as much; eight TP-1
    # instances hold both. Bursty: every arrival within 0.2 s of 0.5 s or 5.5 s (the bins here are
    # a quarter of the window); steady: the same number evenly spaced
    rng = np.random.default_rng(1)
    bursty = np.sort(np.concatenate([5 * k + 0.5 + rng.uniform(0, 0.2, 1200) for k in range(2)]))
    bursty = bursty[bursty < 10.0]
    steady = np.linspace(0.0, 10.0, len(bursty), endpoint=False)
    on, plain = make(tp_latency), make(tp_latency, price_bursts=False)  # on by default
    steady_pred, blind = window(make(tp_latency), steady), window(plain, bursty)
    bursty_pred = window(on, bursty)
    assert on.spread(10.0, [SHAPE]) is not None
    assert bursty_pred[(8,)].attainment < steady_pred[(8,)].attainment - 0.2  # the bursts cost its deadlines
    assert bursty_pred[(1,) * 8].attainment > 0.9  # the layout that holds a burst keeps them
    assert bursty_pred[(1,) * 8].attainment - bursty_pred[(8,)].attainment \
        > steady_pred[(1,) * 8].attainment - steady_pred[(8,)].attainment + 0.2
    # without it only the mean rate counts
    for lay, p in blind.items():
        assert p.attainment == pytest.approx(steady_pred[lay].attainment, abs=0.02)


def test_refinement_chooses_within_the_shortlist_by_what_the_replays_realise(tp_latency):
    # at 60 req/s the analytic chain puts one TP-8 instance first (see the feedback test above)
    plain = make(tp_latency, window_s=10.0)
    assert _steady(plain, 60.0, 30.0, realised=None) == (8,)
    calls = []

    def refiner(layouts, arrivals, now):
        calls.append((now, list(layouts), [t for t, _ in arrivals]))
        # the replays say the last of the shortlist is the one that realises its deadlines
        return [LayoutPrediction(lay, 0.99 if lay == layouts[-1] else 0.5, 0.1, 0.9) for lay in layouts]

    ctl = make(tp_latency, window_s=10.0, refine_candidates=3, refine_window_s=5.0, refine_every_s=4.0)
    ctl.refinement = Refinement(ctl.cfg, refiner)
    final = _steady(ctl, 60.0, 30.0, realised=None)
    assert calls
    shortlists = {tuple(c[1]) for c in calls}
    first = calls[0][1]
    assert len(first) == 3 and first[0] == (8,)  # the current layout, then the analytic best (itself) and two more
    assert final in {lay for s in shortlists for lay in s} and final != (8,)
    for now, layouts, times in calls:  # replays only of the window's last refine_window_s
        assert times and min(times) >= now - 5.0 and max(times) <= now
    # replays are reused for refine_every_s while the shortlist holds: far fewer than the rounds
    assert len(calls) < len(ctl.history) / 2
    assert all(lay in shortlists for lay in map(tuple, [c[1] for c in calls]))
    with pytest.raises(ValueError, match="replay window"):
        ControllerConfig(refine_candidates=2, refine_window_s=60.0)
