"""Latency feedback: a served layout's realised/predicted latency ratio, remembered per layout at its load."""
import pytest

from dilaserve_jax.serving.policy.feedback import LatencyMemory
from dilaserve_jax.serving.policy.layout_eval import LayoutPrediction


def memory(**kw):
    cfg = dict(min_requests=20, smoothing=0.5, rate_tolerance=0.25, memory_s=100.0) | kw
    return LatencyMemory(**cfg)


def test_a_ratio_needs_enough_finished_requests_and_is_smoothed_over_rounds():
    mem = memory()
    assert mem.observe((8,), 0.0, 10.0, 1.0, (3.0, 19)) is None  # too few
    assert mem.observe((8,), 0.0, 10.0, 1.0, None) is None
    assert mem.observe((8,), 2.0, 10.0, 1.0, (3.0, 20)).ratio == pytest.approx(3.0)
    assert mem.observe((8,), 4.0, 10.0, 2.0, (2.0, 40)).ratio == pytest.approx(2.0)  # halfway from 3 to 1
    assert mem.observe((8,), 6.0, 10.0, 1.0, (100.0, 40)).ratio == pytest.approx(0.5 * (2.0 + 4.0))  # capped at 4
    assert memory(min_requests=0).observe((8,), 0.0, 10.0, 1.0, (3.0, 500)) is None  # off


def test_a_remembered_ratio_applies_near_its_load_and_within_its_span_only():
    mem = memory()
    mem.observe((4, 4), 10.0, 20.0, 0.5, (1.0, 50))  # ran twice as slow as predicted at 20 req/s
    preds = {(4, 4): LayoutPrediction((4, 4), 0.9, 0.5, 0.8), (8,): LayoutPrediction((8,), 0.95, 0.4, 0.7)}
    out = mem.correct(preds, 24.0, 50.0)
    assert out[(4, 4)].latency_s == pytest.approx(1.0) and out[(4, 4)].attainment == 0.9
    assert out[(8,)] == preds[(8,)]  # never served: the chain's figure
    assert mem.correct(preds, 26.0, 50.0) == preds  # 30% off the load it was measured at
    assert mem.correct(preds, 20.0, 111.0) == preds  # forgotten
    with pytest.raises(ValueError):
        memory(smoothing=0.0)
