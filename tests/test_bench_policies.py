"""The policies benchmark: per-task block lengths tile every answer area, and the benchmark runs end to end."""
import pytest

from dilaserve_jax.tasks.suite import TASKS, task_block


def test_every_task_answer_area_is_whole_blocks():
    for t in TASKS.values():
        block = task_block(t.gen_length)
        assert 0 < block <= 32 and t.gen_length % block == 0


def test_untileable_answer_area_is_rejected():
    with pytest.raises(ValueError, match="whole number"):
        task_block(40)


@pytest.mark.slow  # ~40 s each on 2 CPU cores: profiles and compiles the shapes of one small pool
@pytest.mark.parametrize("clock", ["real", "modeled"])
def test_policies_benchmark_runs_end_to_end_on_the_shipped_model(capsys, clock):
    import json

    from dilaserve_jax.bench.policies import budget_label, main

    assert main(["--per-task", "1", "--duration", "0.5", "--rates", "4", "--slots", "2", "--clock", clock,
                 "--max-accuracy-drop", "0", "5", "inf", "--no-progress", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["rows"]
    assert {r["policy"] for r in rows} == {"fcfs-static", "edf-static", "dilaserve"}
    assert {(r["mode"], r["budget"]) for r in rows if r["policy"] == "dilaserve"} == {
        ("adaptive", 0.0), ("adaptive", 5.0), ("adaptive", None), ("floor", 5.0)}  # floor 0.85 < 0.9 at 5 points
    for r in rows:
        assert r["requests"] > 0 and r["completed"] + r["rejected"] == r["requests"]
        assert 0.0 <= r["accuracy"] <= 1.0 and r["tokens_per_step"] >= 1.0
        recs = out["requests"][f"{r['policy']}|{r['mode']}|{budget_label(r['budget'])}|{r['rate']:g}"]
        assert len(recs) == r["requests"]
        for rec in recs:  # per request: τ trajectory, graded validity, predicted loss
            assert len(rec["taus"]) == len(rec["committed_per_step"]) == rec["steps"]
            assert rec["committed"] == sum(rec["committed_per_step"])
            assert (rec["valid"] is None) == (rec["state"] != "FINISHED_OK")
            assert rec["predicted_loss"] >= 0.0
        if r["policy"] == "dilaserve" and r["budget"] == 0.0:
            assert all(t >= 0.9 for rec in recs for t in rec["taus"])
