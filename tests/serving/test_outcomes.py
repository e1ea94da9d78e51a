"""What the current layout realised: finishes since a time, plus requests in flight past their deadline."""
import pytest

from dilaserve_jax.serving.policy.outcomes import RecentOutcomes, realised


def test_recent_outcomes_keep_the_last_finishes_and_publish_one_copy_per_change():
    rec = RecentOutcomes(window=3)
    assert rec.published() == ()
    for t, ok in [(1.0, True), (2.0, False), (3.0, True), (4.0, True)]:
        rec.observe(t, ok)
    first = rec.published()
    assert first == ((2.0, False), (3.0, True), (4.0, True))
    assert rec.published() is first  # not copied again until the next finish
    rec.observe(5.0, False)
    assert rec.published() == ((3.0, True), (4.0, True), (5.0, False))
    with pytest.raises(ValueError):
        RecentOutcomes(window=0)


def test_realised_counts_finishes_since_a_time_and_overdue_requests_as_misses():
    a = ((1.0, True), (5.0, True), (6.0, False))
    b = ((7.0, True),)
    # since 4: 3 finishes, 2 met; deadlines 8.5 and 9.5 passed at 10, 11 not yet
    assert realised([a, b], [8.5, 9.5, 11.0], since=4.0, now=10.0) == (2, 3 + 2)
    assert realised([a, b], [], since=0.0, now=10.0) == (3, 4)
    assert realised([], [], since=0.0, now=1.0) == (0, 0)
