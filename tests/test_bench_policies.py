"""The policies benchmark: per-task block lengths tile every answer area, trace rows become pool prompts by
their answer length, the report's columns, and the benchmark runs end to end."""
import math

import numpy as np
import pytest

from dilaserve_jax.tasks.suite import TASKS, task_block

POOL_TASKS = ["sort"] * 3 + ["upper"] * 3 + ["repeat"] * 3 + ["altcase"] * 3  # pool item i is of task POOL_TASKS[i]


def write_trace(path, generated, gap_s=0.5):
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"2023-11-16 18:{k * gap_s // 60:02.0f}:{k * gap_s % 60:06.3f},100,{g}" for k, g in enumerate(generated)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_every_task_answer_area_is_whole_blocks():
    for t in TASKS.values():
        block = task_block(t.gen_length)
        assert 0 < block <= 32 and t.gen_length % block == 0


def test_untileable_answer_area_is_rejected():
    with pytest.raises(ValueError, match="whole number"):
        task_block(40)


def test_trace_rows_become_prompts_of_the_task_with_their_answer_length(tmp_path):
    from dilaserve_jax.bench.policies_workload import Workload

    generated = [3, 12, 13, 200] * 50  # 12 or fewer: a 12-token task; more: a 96-token one
    csv = write_trace(tmp_path / "trace.csv", generated)
    idle = [0.01 * (i + 1) for i in range(len(POOL_TASKS))]
    every = Workload(POOL_TASKS, duration=5.0, slo_range=(2, 6), slo_factor=4.0, trace=csv, seed=1)
    trace = every.trace(8.0, idle, seed=0)
    assert len(trace) == 40  # rate x duration arrivals: 40 consecutive rows, 10 of each length
    times = [t for t, _, _ in trace]
    assert times[0] == 0.0 and times == sorted(times) and times[-1] < 5.0
    kinds = [POOL_TASKS[i] for _, i, _ in trace]
    assert kinds.count("sort") + kinds.count("repeat") == 20 and kinds.count("upper") + kinds.count("altcase") == 20
    for _, i, slo in trace:  # SLO = 4 x the median idle latency of the item's task
        same_task = [idle[j] for j, task in enumerate(POOL_TASKS) if task == POOL_TASKS[i]]
        assert slo == pytest.approx(4.0 * float(np.median(same_task)))
    long = Workload(POOL_TASKS, duration=5.0, slo_range=(4, 4), trace=csv, trace_min_generated=13, seed=1)
    trace = long.trace(8.0, idle, seed=0)
    assert {POOL_TASKS[i] for _, i, _ in trace} == {"upper", "altcase"}
    assert all(slo == pytest.approx(4.0 * idle[i]) for _, i, slo in trace)  # --slo-range 4 4: own idle latency
    assert {POOL_TASKS[i] for i in long.capacity_items(32)} == {"upper", "altcase"}  # capacity on the same mix
    with pytest.raises(ValueError, match="rows"):
        long.trace(1000.0, idle, seed=0)  # more arrivals than the trace has rows


def test_report_columns_count_refusals_late_answers_and_the_paired_drop():
    from dilaserve_jax.bench.policies_report import HEAD, format_row, paired_drop, run_row

    def rec(state, met, latency, valid):
        ok = state == "FINISHED_OK"
        return {"state": state, "met": met, "arrival": 0.0, "finish": latency if ok else 0.0,
                "latency": latency if ok else None, "valid": valid if ok else None, "valid_at_static_tau": True,
                "steps": 2, "tau_sum": 1.6, "committed": 12, "moves": 0, "predicted_loss": 0.0}

    recs = [rec("FINISHED_OK", True, 1.0, True), rec("FINISHED_OK", False, 3.0, False),
            rec("FINISHED_OK", False, 5.0, True), rec("FINISHED_REJECTED", False, None, None)]
    row = run_row("dilaserve", 1.0, "defaults", 2.0, recs, [], 0.0, 1.0, duration=1.0) | {"budget_mode": "adaptive"}
    assert row["slo_attainment"] == 0.25 and row["served_attainment"] == pytest.approx(1 / 3)
    assert row["late"] == 2 and row["late_latency"] == 4.0 and row["rejected"] == 1
    base = [rec("FINISHED_OK", True, 1.0, True)] * 3 + [rec("FINISHED_OK", True, 1.0, False)]
    assert paired_drop(base, recs) == pytest.approx(100 / 3)  # the refused one is left out
    assert math.isnan(paired_drop(base, [rec("FINISHED_REJECTED", False, None, None)] * 4))
    row |= {"paired_drop_vs_fcfs": paired_drop(base, recs), "load": 1.5, "slo_gain": 0.1, "latency_change": -0.5,
            "accuracy_drop": 0.0}
    line = format_row(row)
    assert line.startswith("dilaserve (defaults)") and len(line) == len(HEAD)
    cells = line[len("dilaserve (defaults)"):].split()
    assert cells[:2] == ["adaptive", "1"] and cells[4:8] == ["4", "1", "25.0", "33.3"]  # n, refused, SLO %, srv %
    assert cells[12] == "4.00" and cells[18] == "+33.33"  # late s, vs fcfs


@pytest.mark.slow  # ~40 s each on 2 CPU cores: profiles and compiles the shapes of one small pool
@pytest.mark.parametrize("clock, workload", [("real", "poisson"), ("modeled", "poisson"), ("modeled", "trace")])
def test_policies_benchmark_runs_end_to_end_on_the_shipped_model(capsys, tmp_path, clock, workload):
    import json

    from dilaserve_jax.bench.policies import budget_label, main

    budgets = ["0", "5", "inf"]
    extra = []
    if workload == "trace":  # long answers only: every request a 96-token task, SLO 4 x its task's median idle
        csv = write_trace(tmp_path / "trace.csv", [5, 40, 90, 3, 200] * 20)
        extra = ["--trace", csv, "--trace-min-generated", "13", "--slo-factor", "4"]
    assert main(["--per-task", "1", "--duration", "0.5", "--rates", "4", "--slots", "2", "--clock", clock,
                 "--max-accuracy-drop", *budgets, "--no-progress", "--json", *extra]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["rows"]
    assert {r["policy"] for r in rows} == {"fcfs-static", "edf-static", "dilaserve"}
    assert {(r["mode"], r["budget"]) for r in rows if r["policy"] == "dilaserve"} == {
        ("defaults", 1.0),  # serve's: budget 1 point from the eval rows' plateau
        ("adaptive", 0.0), ("adaptive", 5.0), ("adaptive", None), ("floor", 5.0)}  # floor 0.85 < 0.9 at 5 points
    assert out["info"]["defaults"] == {"policy": "dilaserve", "tau_range": [0.5, 0.9], "budget": 1.0,
                                       "budget_mode": "adaptive", "admission": "best-effort"}
    for r in rows:
        assert r["requests"] > 0 and r["completed"] + r["rejected"] == r["requests"]
        assert 0.0 <= r["accuracy"] <= 1.0 and r["tokens_per_step"] >= 1.0
        recs = out["requests"][f"{r['policy']}|{r['mode']}|{budget_label(r['budget'])}|{r['rate']:g}"]
        assert len(recs) == r["requests"]
        assert r["served_attainment"] == pytest.approx(sum(x["met"] for x in recs) / r["completed"])
        for rec in recs:  # per request: τ trajectory, graded validity, predicted loss
            assert len(rec["taus"]) == len(rec["committed_per_step"]) == rec["steps"]
            assert rec["committed"] == sum(rec["committed_per_step"])
            assert (rec["valid"] is None) == (rec["state"] != "FINISHED_OK")
            assert rec["predicted_loss"] >= 0.0
            if workload == "trace":
                assert rec["task"] in ("upper", "altcase")
        if r["policy"] == "dilaserve" and r["budget"] == 0.0:
            assert all(t >= 0.9 for rec in recs for t in rec["taus"])
        if r["mode"] == "defaults":
            assert all(0.5 <= t <= 0.9 for rec in recs for t in rec["taus"]) and r["rejected"] == 0  # best effort
        if r["policy"] == "fcfs-static":
            assert r["paired_drop_vs_fcfs"] == 0.0
