"""The changing-load evaluation: its workloads at a time scale, its systems, and the issue's verdicts
on hand-built rows (each verdict both ways)."""
import math

import pytest

from dilaserve_jax.sim.evaluate_changing import (AUTO, ChangingConfig, dominates, jobs_of, relative_verdict, systems,
                                                 tight_verdict, verdict, workload_args)


def _row(system, att, lat):
    return {"system": system, "slo_attainment": att, "mean_latency": lat}


STATIC = ["fcfs-static 8x1", "edf-static 2x4", "dilaserve 4x2"]


def test_tight_slos_need_auto_ten_points_above_every_static_system():
    rows = [_row(AUTO, 0.60, 1.0), _row(STATIC[0], 0.45, 0.5), _row(STATIC[1], 0.49, 2.0), _row(STATIC[2], 0.30, 1.0)]
    v = tight_verdict(rows)
    assert v["ok"] and v["best_static"] == STATIC[1] and v["gap_points"] == pytest.approx(11.0)
    rows[2] = _row(STATIC[1], 0.51, 2.0)  # 9 points short of auto: not beaten by 10
    v = tight_verdict(rows)
    assert v["ok"] is False and v["not_beaten"] == [STATIC[1]] and "need >= +10" in v["reason"]
    assert verdict(rows, 8)["ok"] is False and tight_verdict(rows[:1])["ok"] is None


def test_relative_slos_need_every_static_system_worse_or_slower():
    auto = _row(AUTO, 0.90, 1.00)
    assert dominates(_row("s", 0.90, 1.00), auto)  # as good and as fast
    assert dominates(_row("s", 0.86, 1.19), auto)  # 4 points worse, 19% slower: still dominates
    assert not dominates(_row("s", 0.85, 0.50), auto)  # 5 points worse
    assert not dominates(_row("s", 0.99, 1.20), auto)  # better attainment but 20% slower
    assert not dominates(_row("s", 0.99, math.nan), auto)  # nothing completed: infinitely slow
    rows = [auto, _row(STATIC[0], 0.80, 0.9), _row(STATIC[1], 0.95, 1.3), _row(STATIC[2], 0.89, 5.0)]
    assert relative_verdict(rows)["ok"] and verdict(rows, 1)["ok"]
    rows.append(_row("edf-static 8x1", 0.88, 0.95))  # 2 points worse, faster: dominates auto
    v = relative_verdict(rows)
    assert v["ok"] is False and v["dominated_by"] == ["edf-static 8x1"] and "edf-static 8x1" in v["reason"]


def test_workloads_compress_their_timelines_and_every_static_layout_runs(tmp_path):
    assert workload_args("diurnal", trace="t.csv", time_scale=0.25, trace_speed=15)["trace"] == "diurnal:55:300:0.818"
    step = workload_args("step", trace="t.csv", time_scale=0.5, trace_speed=15)
    assert step["trace"] == "steps:20@150,90@150,20@150" and step["duration"] == 450 and step["lengths"] == "t.csv"
    tr = workload_args("trace", trace="t.csv", time_scale=1, trace_speed=15)
    assert (tr["trace"], tr["rate_scale"], tr["duration"], tr["lengths"]) == ("t.csv", 15, 900, None)
    with pytest.raises(ValueError):
        workload_args("burst", trace="t.csv", time_scale=1, trace_speed=15)
    names = [f"{p} {lay}" for p, lay in systems(8)]
    assert len(names) == 13 and names[-1] == AUTO
    assert {"fcfs-static 1x8", "edf-static 4x2", "dilaserve 8x1", "dilaserve 2x4"} <= set(names)
    csv = tmp_path / "t.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,1,1\n")
    jobs = jobs_of(ChangingConfig(trace=str(csv), workloads=("step", "trace"), slo_tps=(1, 8), time_scale=0.1))
    assert len(jobs) == 2 * 2 * 13 and {j["slo_tp"] for j in jobs} == {1, 8}
    assert all(j["duration"] == pytest.approx(90.0) for j in jobs)


def test_steady_load_verdict_over_seeds_and_the_evaluate_parsers():
    from dilaserve_jax.sim import evaluate, evaluate_changing
    from dilaserve_jax.sim.evaluate import over_seeds, steady_verdicts

    def r(system, seed, att, lat, rate=50.0):
        return {"workload": "poisson", "devices": 8, "system": system, "rate": rate, "seed": seed,
                "slo_attainment": att, "mean_latency": lat, "requests": 100}

    rows = over_seeds([r(AUTO, 0, 0.95, 0.2), r(AUTO, 1, 0.91, 0.2), r("dilaserve 4x2", 0, 0.95, 0.1),
                       r("dilaserve 4x2", 1, 0.93, 0.1), r("edf-static 8x1", 0, 0.50, 0.1),
                       r("edf-static 8x1", 1, 0.5, 0.1)])
    auto = next(x for x in rows if x["system"] == AUTO)
    assert auto["slo_attainment"] == pytest.approx(0.93) and auto["min_slo_attainment"] == 0.91 and auto["seeds"] == 2
    (v,) = steady_verdicts(rows, ["dilaserve 4x2", "edf-static 8x1"])
    # within 2 points of the best static system, but both >= 90% and twice its latency: fails
    assert v["best_static"] == "dilaserve 4x2" and v["gap_points"] == pytest.approx(-1.0) and not v["ok"]
    (v,) = steady_verdicts(rows, ["edf-static 8x1"])
    assert v["ok"] and v["latency_change"] is None
    for mod in (evaluate, evaluate_changing):  # every flag says what it does
        parser = mod.build_parser()
        assert parser.description and not [a.dest for a in parser._actions if not a.help]


def test_resume_keys_read_rows_with_and_without_a_seed():
    from dilaserve_jax.sim.evaluate_changing import _key

    row = {"workload": "step", "slo_tp": 8, "devices": 8, "system": AUTO, "time_scale": 0.2}
    assert _key(row) == _key({**row, "seed": 0}) != _key({**row, "seed": 1})
