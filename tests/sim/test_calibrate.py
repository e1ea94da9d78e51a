"""The controller's predictions against the simulator, on a small grid (a regression bound)."""
from pathlib import Path

import pytest

from dilaserve_jax.sim.calibrate import CalibrateConfig, calibrate, format_rows, main, published_rates

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "azure_llm_2023_code.csv"


@pytest.mark.skipif(not TRACE.is_file(), reason="the code trace is not beside the checkout")
def test_predictions_stay_within_ten_points_of_the_simulator_below_capacity():
    # one full window of arrivals (30 s): the controller's predictions are made at the end of one
    cfg = CalibrateConfig(lengths=str(TRACE), rates=(10, 30), layouts=("2x4", "8x1"), duration=30, jobs=1,
                          progress=False)
    rows, ranks, _ = calibrate(cfg)
    assert len(rows) == 4 and all(0 <= r["sim_attainment"] <= 1 for r in rows)
    assert max(abs(r["error_points"]) for r in rows) <= 10, format_rows(rows, ranks, cfg)
    assert all(k["ok"] for k in ranks), format_rows(rows, ranks, cfg)


def test_fixed_length_predictions_stay_within_ten_points_below_capacity():
    cfg = CalibrateConfig(rates=(10, 30), layouts=("4x2", "8x1"), duration=10, jobs=1, progress=False)
    rows, ranks, _ = calibrate(cfg)
    assert len(rows) == 4
    assert max(abs(r["error_points"]) for r in rows) <= 10, format_rows(rows, ranks, cfg)
    assert all(k["ok"] for k in ranks), format_rows(rows, ranks, cfg)


def test_fixed_lengths_table_and_bad_input(capsys):
    assert main(["--rates", "8", "--layouts", "1x2", "2x1", "--devices", "2", "--duration", "5", "--jobs", "1",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "1x2" in out and "2x1" in out and "attainment error" in out
    assert main(["--rates", "-1"]) == 2
    assert "--rates must be positive" in capsys.readouterr().err


def test_fixed_length_first_choice_is_the_simulated_best_above_capacity():
    # 30 and 50 req/s overload 1x8 and 2x4 (the simulator measures 17% and 6% on 1x8)
    cfg = CalibrateConfig(rates=(30, 50), layouts=("8x1", "2x4", "1x8"), duration=10, jobs=1, progress=False)
    rows, ranks, _ = calibrate(cfg)
    assert len(rows) == 6
    assert all(k["ok"] for k in ranks), format_rows(rows, ranks, cfg)


@pytest.mark.skipif(not TRACE.is_file(), reason="the code trace is not beside the checkout")
def test_tight_slos_price_the_late_work_of_narrow_instances():
    # SLOs set by a TP-8 instance: a third of the requests miss on a TP-1 instance even when it is
    # idle, and they still run in the steps of the others; priced as free, 8x1 at 50 req/s was
    # predicted 17 points above the simulator (60.5% against 43.5%, 30 s)
    cfg = CalibrateConfig(lengths=str(TRACE), rates=(50,), layouts=("8x1",), slo_tp=8, duration=20, jobs=1,
                          progress=False)
    rows, ranks, _ = calibrate(cfg)
    assert len(rows) == 1 and rows[0]["sim_attainment"] < 0.7  # the regime: many miss
    assert abs(rows[0]["error_points"]) <= 10, format_rows(rows, ranks, cfg)


@pytest.mark.skipif(not TRACE.is_file(), reason="the code trace is not beside the checkout")
@pytest.mark.parametrize("pricing", ["price_answer_ends", "latency_at_answer_ends"])
def test_latency_below_capacity_is_predicted_within_a_fifth(pricing):
    # answers end inside their last block (the code trace's median is 15 positions of a 32-position
    # area) and the rates the instances measure are below the table's: priced at the whole area and
    # the table, 2x4 and 1x8 at 10 req/s were predicted 29-32% too slow (both pricings are opt-in)
    cfg = CalibrateConfig(lengths=str(TRACE), rates=(10,), layouts=("2x4", "1x8"), duration=10, jobs=1,
                          progress=False, **{pricing: True})
    rows, ranks, _ = calibrate(cfg)
    assert len(rows) == 2
    assert all(0.8 <= r["pred_latency"] / r["sim_latency"] <= 1.25 for r in rows), format_rows(rows, ranks, cfg)


def test_the_published_rates_are_what_the_instances_measure_not_the_table():
    from dilaserve_jax.sim.quality import QualityModel
    from dilaserve_jax.sim.workload import RequestSpec

    quality = QualityModel.from_table("llada_8b")
    specs = [RequestSpec(0.0, "gsm8k", (1,) * 100, 256, 32, finish_tokens=200)] * 16
    ninety, sixty = published_rates(quality, specs, (0.9, 0.6))
    # a block takes ceil(32 / (rate x a log-normal factor)) steps: more than 32 / rate on average
    for measured, tau in ((ninety, 0.9), (sixty, 0.6)):
        assert 0.7 * quality.table_rate(tau) < measured < quality.table_rate(tau)
