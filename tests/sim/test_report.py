"""The shared report: attainment counts rejections as misses; the headline picks the paper's comparison point."""
import math

import pytest

from dilaserve_jax.sim.report import format_table, headline, summarize


def _rec(state, arrival, finish, met, valid=None, steps=2, tau_sum=1.8):
    return {"state": state, "arrival": arrival, "finish": finish, "met": met, "valid": valid, "steps": steps,
            "tau_sum": tau_sum, "committed": 10}


def test_summary_counts_rejections_and_failures_as_misses():
    recs = [_rec("FINISHED_OK", 0.0, 1.0, True, True), _rec("FINISHED_OK", 1.0, 4.0, False, False),
            _rec("FINISHED_REJECTED", 2.0, None, False), _rec("UNAVAILABLE", 3.0, None, False)]
    s = summarize(recs, duration=4.0)
    assert s["requests"] == 4 and s["completed"] == 2 and s["rejected"] == 1 and s["failed"] == 1
    assert s["slo_attainment"] == 0.25 and s["accuracy"] == 0.5 and s["graded"] == 2
    assert s["mean_latency"] == pytest.approx(2.0) and s["mean_tau"] == pytest.approx(0.9)
    assert s["offered_rate"] == 1.0
    empty = summarize([_rec("FINISHED_REJECTED", 0.0, None, False)])
    assert empty["slo_attainment"] == 0.0 and math.isnan(empty["mean_latency"]) and math.isnan(empty["accuracy"])


def test_headline_compares_at_the_first_rate_where_the_best_static_system_fails_half():
    def row(system, rate, att, lat, acc):
        return {"system": system, "rate": rate, "slo_attainment": att, "mean_latency": lat, "accuracy": acc,
                "requests": 100, "rejected": 0, "p50_latency": lat, "p99_latency": lat, "mean_tau": 0.9}
    rows = [row("a 2x4", 10, 0.9, 1.0, 0.8), row("b 8x1", 10, 0.95, 1.0, 0.8), row("ours", 10, 1.0, 0.5, 0.8),
            row("a 2x4", 20, 0.3, 4.0, 0.8), row("b 8x1", 20, 0.6, 2.0, 0.8), row("ours", 20, 0.9, 1.0, 0.79),
            row("a 2x4", 30, 0.2, 6.0, 0.8), row("b 8x1", 30, 0.4, 3.0, 0.8), row("ours", 30, 0.8, 1.5, 0.78)]
    h = headline(rows, "ours", ["a 2x4", "b 8x1"])
    assert h["rate"] == 30 and h["best_static"] == "b 8x1"
    assert h["gain_points"] == pytest.approx(40.0) and h["latency_change"] == pytest.approx(-0.5)
    assert h["accuracy_change_points"] == pytest.approx(-2.0)
    assert headline(rows[:3], "ours", ["a 2x4", "b 8x1"]) is None
    assert "ours" in format_table(rows)
