"""The simulator-validation command: the real side (the policies benchmark's serving loop) records
every step, and a saved real run re-simulates to the same comparison."""
import json

import pytest


@pytest.mark.slow  # ~1 min on 2 CPU cores: profiles and compiles the shapes of one small pool
def test_real_runs_are_recorded_and_re_simulate_the_same(tmp_path, capsys):
    from dilaserve_jax.bench.sim_validate import main

    args = ["--load-factors", "1.0", "--duration", "0.5", "--per-task", "1", "--slots", "2", "--sim-seeds", "1",
            "--policies", "fcfs-static", "dilaserve", "--no-progress", "--json"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    first = json.loads(capsys.readouterr().out)
    measured = json.loads((tmp_path / "measured.json").read_text())
    assert (tmp_path / "profile.json").exists()
    assert {r["policy"] for r in measured["runs"]} == {"fcfs-static", "dilaserve"}
    for run in measured["runs"]:
        assert run["steps"] and run["busy_wall_s"] > 0
        for kind, shapes, t0, t1 in run["steps"]:  # each step: its kind, its requests' (canvas, block), times
            assert kind in (0, 1) and shapes and t1 >= t0
        finished = [r for r in run["records"] if r["state"] == "FINISHED_OK"]
        assert sum(r["steps"] for r in finished) <= len(run["steps"]) * 2  # at most 2 slots per step
    assert [r["policy"] for r in first["rows"]] and all("d_attainment_points" in r["compare"] for r in first["rows"])

    assert main([*args, "--from", str(tmp_path / "measured.json")]) == 0
    again = json.loads(capsys.readouterr().out)
    sims = [json.dumps([r["sim"] for r in out["rows"]]) for out in (first, again)]
    assert sims[0] == sims[1]  # the simulator is deterministic
