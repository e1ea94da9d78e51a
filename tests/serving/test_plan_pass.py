"""The plan's cap search (`plan_pass.boundary`) and its pass helpers, without a model: the search
finds what a test of every cap would find, in few tests when the answer has not moved."""
import itertools
import math

import pytest

from dilaserve_jax.bench.host_time import HostTimeConfig, measure
from dilaserve_jax.serving.policy import threshold
from dilaserve_jax.serving.policy.plan_pass import Decision, boundary, first_at_or_below, make_decision


def _search(truth, start):
    tested = []

    def passes(i):
        tested.append(i)
        return truth[i]
    return boundary(passes, start, len(truth)), tested


@pytest.mark.parametrize("n", [1, 2, 3, 5, 11, 12])
def test_the_search_finds_the_boundary_of_a_monotone_test_from_any_start(n):
    for answer in range(n + 1):  # answer == n: no cap passes
        truth = [i >= answer for i in range(n)]
        for start in range(n):
            found, tested = _search(truth, start)
            assert found == (None if answer == n else answer), (n, answer, start)
            assert len(tested) == len(set(tested))  # no cap is tried twice
            assert len(tested) <= 2 * math.ceil(math.log2(n)) + 2 if n > 1 else len(tested) == 1


def test_an_answer_that_has_not_moved_costs_two_tests():
    truth = [i >= 4 for i in range(11)]
    assert _search(truth, 4) == (4, [4, 3])  # it passes, the next higher cap does not
    assert _search([True] * 11, 0) == (0, [0])  # the highest cap passes: nothing above it to try


def test_a_test_that_is_not_monotone_still_gets_a_passing_cap():
    for truth in itertools.product([False, True], repeat=6):
        for start in range(6):
            found, tested = _search(list(truth), start)
            if found is None:
                assert not any(truth[i] for i in tested) and (5 in tested)
            else:
                assert truth[found] and found in tested
                assert found == 0 or (found - 1 in tested and not truth[found - 1])  # the next cap up failed


def test_first_at_or_below_and_decisions():
    taus = (1.0, 0.9, 0.7, 0.5)
    assert [first_at_or_below(taus, c) for c in (1.0, 0.95, 0.9, 0.6, 0.5, 0.3)] == [0, 1, 1, 3, 3, 3]
    d = make_decision((0.9, False, 3.0, 1.0))
    assert d == Decision(0.9, False, 3.0, 1.0) and type(d) is Decision
    assert d.slack_if_started(5.0, 2.0) == 1.0


def test_a_steady_plan_tests_few_caps(monkeypatch):
    """At a steady deep queue the search starts from last round's cap: the floor pass and about two
    tests a round, not a bisection of the whole grid (counted passes, not seconds)."""
    calls = []
    orig = threshold.schedule_pass
    monkeypatch.setattr(threshold, "schedule_pass", lambda *a: calls.append(a[3]) or orig(*a))
    cfg = HostTimeConfig(iterations=200)
    out = measure("dilaserve", 256, cfg)
    grid = len(threshold.ThresholdConfig().grid)
    assert out["iterations"] == cfg.iterations
    per_round = len(calls) / cfg.iterations
    assert 2 <= per_round <= 3.5, per_round  # floor + 1-2.5 tests (a bisection of 11-12 caps takes ~4.5)
    assert per_round < 1 + math.log2(grid + 1)
