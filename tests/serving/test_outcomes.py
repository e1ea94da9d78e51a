"""What the current layout realised: finishes since a time, plus requests in flight past their deadline,
and the mean latency of the requests that arrived since then."""
import pytest

from dilaserve_jax.serving.policy.outcomes import RecentOutcomes, realised, realised_latency


def test_recent_outcomes_keep_the_last_finishes_and_publish_one_copy_per_change():
    rec = RecentOutcomes(window=3)
    assert rec.published() == ()
    for t, ok in [(1.0, True), (2.0, False), (3.0, True), (4.0, True)]:
        rec.observe(t, ok, 0.5)
    first = rec.published()
    assert first == ((2.0, False, 0.5), (3.0, True, 0.5), (4.0, True, 0.5))
    assert rec.published() is first  # not copied again until the next finish
    rec.observe(5.0, False, 2.0)
    assert rec.published() == ((3.0, True, 0.5), (4.0, True, 0.5), (5.0, False, 2.0))
    with pytest.raises(ValueError):
        RecentOutcomes(window=0)


def test_realised_counts_finishes_since_a_time_and_overdue_requests_as_misses():
    a = ((1.0, True, 0.5), (5.0, True, 0.5), (6.0, False, 3.0))
    b = ((7.0, True, 1.0),)
    # since 4: 3 finishes, 2 met; deadlines 8.5 and 9.5 passed at 10, 11 not yet
    assert realised([a, b], [8.5, 9.5, 11.0], since=4.0, now=10.0) == (2, 3 + 2)
    assert realised([a, b], [], since=0.0, now=10.0) == (3, 4)
    assert realised([], [], since=0.0, now=1.0) == (0, 0)


def test_realised_latency_counts_only_requests_that_arrived_since_the_time():
    a = ((1.0, True, 0.5), (5.0, True, 0.5), (6.0, False, 3.0))  # the last arrived at 3.0: before 4
    b = ((7.0, True, 1.0),)
    assert realised_latency([a, b], since=4.0) == (pytest.approx(0.75), 2)
    assert realised_latency([a, b], since=0.0) == (pytest.approx(5.0 / 4), 4)
    assert realised_latency([a], since=10.0) == (0.0, 0)
