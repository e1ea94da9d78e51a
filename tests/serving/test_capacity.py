"""The capacity model's arithmetic: beyond its table, and the price of a refresh."""
from dataclasses import replace

import numpy as np

from dilaserve_jax.core.kinds import StepKind
from dilaserve_jax.serving.policy.capacity import Curves, RequestShape, StepShapes, service_times
from dilaserve_jax.serving.policy.layout_eval import evaluate_layouts


class _ComputeBound:
    """A refresh costs 10 ms per padded request, a reuse 1 ms flat."""

    def round_many(self, kind, batch, canvas, block, tp):
        b = np.asarray(batch, dtype=np.float64) + 0 * np.asarray(canvas)
        return 0.010 * b if kind == StepKind.REFRESH else 0.001 + 0 * b


class _Linear:
    """A step costs 5 ms per padded request."""

    def round_many(self, kind, batch, canvas, block, tp):
        return 0.005 * (np.asarray(batch, dtype=np.float64) + 0 * np.asarray(canvas))


def _mixed_slos() -> list[RequestShape]:
    """64 requests, prompts of 100-400 tokens, SLOs of 0.1-0.4 s (some miss once the instance loads)."""
    rng = np.random.default_rng(0)
    return [RequestShape(prompt_len=int(p), answer_len=64, block_len=32, slo_s=float(s))
            for p, s in zip(rng.integers(100, 400, 64), rng.uniform(0.1, 0.4, 64))]


def _curves(tp: int, capacity: float) -> Curves:
    rates = np.array([0.0, capacity / 2, capacity, 2 * capacity])
    return Curves(tp, rates, np.array([1.0, 1.0, 0.8, 0.4]), np.array([1.0, 1.2, 2.0, 3.0]),
                  np.array([0.9, 0.9, 0.8, 0.7]), capacity)


def test_beyond_the_table_attainment_falls_as_one_over_the_rate():
    curves = {1: _curves(1, 5.0)}
    at_edge, twice, four = (evaluate_layouts([(1,)], curves, r)[0].attainment for r in (10.0, 20.0, 40.0))
    assert at_edge == 0.4
    assert twice == 0.2 and four == 0.1  # the requests in time are served no faster beyond the table


def test_a_refresh_is_priced_at_the_mean_group_it_runs_in_and_the_others_refreshes_are_waited_for():
    sample = [RequestShape(prompt_len=100, answer_len=64, block_len=32, slo_s=1.0)]
    shapes = StepShapes(batch_buckets=(1, 2, 4, 8))
    t = service_times(_ComputeBound(), 1, sample, 8, np.array([1.0]), np.array([32.0]), shapes)  # [B, T, J]
    # one refresh and no reuse per block (32 tokens a step), two blocks
    assert np.isclose(t[0, 0, 0], 2 * 0.010)
    # at 3 present: groups of 1, 2, 3 (padded to 4) cost 10, 10, 13.3 ms a refresh; 3 refreshes a turn
    assert np.isclose(t[2, 0, 0], 2 * 3 * np.mean([0.010, 0.010, 0.040 / 3]))


def test_past_capacity_the_backlog_adds_its_mean_wait_over_the_horizon():
    curves = {1: _curves(1, 5.0)}
    plain = evaluate_layouts([(1,)], curves, 10.0, overload_horizon_s=None)[0]
    loaded = evaluate_layouts([(1,)], curves, 10.0, overload_horizon_s=30.0)[0]
    assert loaded.attainment == plain.attainment  # the chain's attainment is kept
    # half the arrivals are beyond capacity: the backlog's wait grows to (1 - 5/10)·30 s, 7.5 s on average
    assert np.isclose(loaded.latency_s - plain.latency_s, (1 - 5.0 / 10.0) * 30.0 / 2)
    assert np.isclose(loaded.backlog_s, loaded.latency_s - plain.latency_s) and plain.backlog_s == 0.0
    within = [evaluate_layouts([(1,)], curves, 4.0, overload_horizon_s=h)[0] for h in (None, 30.0)]
    assert within[0].latency_s == within[1].latency_s and within[1].backlog_s == 0.0


def test_the_backlog_is_priced_at_the_capacity_of_the_tau_the_layout_runs():
    # full batches serve 5 req/s at τ 0.6 and half that at 0.9; at 10 req/s the layout runs at τ 0.7
    cv = replace(_curves(1, 5.0), taus=np.array([0.9, 0.6]), capacity_by_tau=np.array([2.5, 5.0]))
    p = evaluate_layouts([(1,)], {1: cv}, 10.0, overload_horizon_s=30.0)[0]
    assert np.isclose(p.tau, 0.7)
    capacity = 5.0 - 2.5 * (0.7 - 0.6) / 0.3
    assert np.isclose(p.latency_s - 3.0, (1 - capacity / 10.0) * 15.0)


def test_a_loaded_instance_is_priced_at_the_floor_under_arrival_pressure():
    """Instances whose arrival-pressure rule is on run everyone at the floor once deadlines are lost,
    and the overload rules keep late work from the requests in time past the capacity as well. The
    rule is on for the part of the time that brings the at-risk share back to the share, which sets
    the τ; the requests found at risk turn it on before they finish, so where the plain chain misses
    the share, attainment and latency are the pressed chain's, ramped in from no misses; the
    backlog is priced at the floor's capacity."""
    from dilaserve_jax.serving.policy.capacity import instance_curves

    sample = _mixed_slos()
    args = (_Linear(), 1, sample, 8, (0.9, 0.7, 0.5), (2.0, 3.2, 4.7))
    plain = instance_curves(*args, tau_floor=0.5)
    pressed = instance_curves(*args, tau_floor=0.5, pressure_share=0.05)
    floored = instance_curves(_Linear(), 1, sample, 8, (0.5,), (4.7,), tau_floor=0.5)  # everyone at the floor
    assert pressed.pressed and not plain.pressed
    on = 1 - plain.attainment >= 0.05
    assert on.any() and (~on).any() and (plain.rates[on] > plain.capacity).any()
    # where the plain chain misses the share: the floor's attainment and latency, no worse than plain
    assert np.allclose(pressed.attainment[on], floored.attainment[on])
    assert np.allclose(pressed.latency[on], floored.latency[on])
    assert np.all(pressed.attainment[on] >= plain.attainment[on] - 1e-9)
    assert (pressed.attainment[on] > 0.95 + 1e-3).any()  # not held at 1 - share
    # below the share: plain moved toward the floor by its miss share over the share (no jump at it)
    ramp = (1 - plain.attainment[~on]) / 0.05
    assert np.allclose(pressed.attainment[~on],
                       plain.attainment[~on] + ramp * (floored.attainment[~on] - plain.attainment[~on]))
    edge = int(np.flatnonzero(on)[0])
    assert abs(pressed.attainment[edge] - pressed.attainment[edge - 1]) < 0.02
    # τ: pressed for the share of the time that brings the misses back to 5% (all of it where even
    # the floor misses more), between the plain chain's and the floor; the plain chain's below
    assert np.array_equal(pressed.tau[~on], plain.tau[~on])
    assert np.all(pressed.tau[on] <= plain.tau[on] + 1e-9) and np.all(pressed.tau[on] >= 0.5 - 1e-9)
    part = on & (pressed.tau > 0.5 + 1e-6)
    assert part.any() and (on & ~part).any()
    assert np.all(floored.attainment[on & ~part] <= 0.95 + 1e-9)
    # the backlog term uses the floor's capacity, not the capacity at the τ the chain predicts
    over = 1.5 * plain.capacity
    p = evaluate_layouts([(1,)], {1: pressed}, over, overload_horizon_s=30.0)[0]
    q = evaluate_layouts([(1,)], {1: pressed}, over, overload_horizon_s=None)[0]
    assert np.isclose(p.latency_s - q.latency_s, (1 - plain.capacity / over) * 15.0)


def test_late_requests_ride_in_the_steps_of_the_requests_in_time():
    """Requests that miss still run (the overload rules put a late one in the steps of the requests
    in time), so while the misses' work lasts every step carries one more request: where many miss
    even on an idle instance the prediction falls below the chain that takes misses as free, and
    where nothing misses it is that chain's."""
    from dilaserve_jax.serving.policy.capacity import instance_curves

    rng = np.random.default_rng(0)
    loose = [RequestShape(prompt_len=int(p), answer_len=64, block_len=32, slo_s=5.0)
             for p in rng.integers(100, 400, 64)]
    # a third cannot make it even alone (two blocks at 4.7 tokens a step: 14 steps of 5 ms)
    tight = [replace(r, slo_s=0.02 if i % 3 == 0 else 5.0) for i, r in enumerate(loose)]
    args = (_Linear(), 1, (0.9, 0.7, 0.5), (2.0, 3.2, 4.7))

    def curves(sample, riders):
        return instance_curves(args[0], args[1], sample, 8, *args[2:], tau_floor=0.5, late_riders=riders)
    free, ridden = curves(tight, 0), curves(tight, 1)
    assert np.array_equal(free.rates, ridden.rates)
    mid = (free.rates > 0.1 * free.capacity) & (free.rates < free.capacity)
    assert np.all(free.attainment[mid] < 0.7)  # the third that misses at any load
    # the late third rides along: the requests in time take longer, so no more of them make it and
    # their latency grows
    assert np.all(ridden.attainment <= free.attainment + 1e-12)
    assert np.all(ridden.latency[mid] > free.latency[mid])
    # nothing misses: nothing rides
    calm, calm_ridden = curves(loose, 0), curves(loose, 1)
    low = calm.rates < 0.5 * calm.capacity
    assert np.allclose(calm.attainment[low], 1.0)
    assert np.allclose(calm_ridden.latency[low], calm.latency[low])


def test_the_time_to_empty_an_m_m_1_chain_is_n_over_mu_minus_lambda():
    """The first passage from n requests in time to none, as `_Chain` computes it from a stationary
    distribution: on an M/M/1 queue (λ 6, μ 10) it is n / (μ - λ)."""
    from dilaserve_jax.serving.policy.capacity import _Chain

    lam, mu, n = 6.0, 10.0, np.arange(400)
    rho = lam / mu
    p = ((1 - rho) * rho ** n)[None, :]
    got = _Chain._to_empty(p, np.array([lam]), np.ones(len(n)))[0]
    assert np.allclose(got[:40], n[:40] / (mu - lam), rtol=1e-9)


def test_a_late_request_waits_for_the_requests_in_time_or_its_starvation():
    """With the scheduler's starvation rounds, a late request waits for the instance to empty of
    requests in time, at most until it starves: its latency grows (up to the miss share times the
    starvation wait) where requests miss, and nothing changes where none do or for attainment and τ."""
    from dilaserve_jax.serving.policy.capacity import instance_curves

    sample = _mixed_slos()

    def curves(rounds):
        return instance_curves(_Linear(), 1, sample, 8, (0.9, 0.7, 0.5), (2.0, 3.2, 4.7), tau_floor=0.5,
                               late_wait_rounds=rounds)
    behind, waits, long_waits = curves(None), curves(128.0), curves(1024.0)
    assert np.array_equal(behind.attainment, waits.attainment) and np.array_equal(behind.tau, waits.tau)
    miss = 1 - behind.attainment
    calm, missing = miss < 1e-9, miss > 0.05
    assert calm.any() and missing.any()
    assert np.allclose(waits.latency[calm], behind.latency[calm])
    assert np.all(waits.latency[missing] > behind.latency[missing])
    assert np.all(long_waits.latency[missing] >= waits.latency[missing] - 1e-12)  # a later starvation waits longer
    # at most the starvation wait on top: 128 rounds at a full batch (8 requests at 5 ms a step)
    starve = 128 * 8 * 0.005
    assert np.all(waits.latency - behind.latency <= miss * starve + 1e-9)
