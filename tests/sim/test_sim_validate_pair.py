"""`bench.sim_validate --instances 2`: a recorded real two-instance run re-simulates on two modelled
instances behind the router — the same instances, every request placed once, the engines' own
arrivals agree with the placements, and one instance instead of two is told apart — and the
command's checks of the instance count and its core pinning."""
import json
import os
import sys
import threading
from pathlib import Path

import pytest

from dilaserve_jax.bench import sim_validate_pair as pair
from dilaserve_jax.bench.sim_inputs import build_simulation, run_inputs, step_time_model
from dilaserve_jax.bench.sim_validate import compare_with_sim, main
from dilaserve_jax.serving.policy.eval_rows import read_eval_rows
from dilaserve_jax.sim.report import summarize
from dilaserve_jax.sim.setup import ASSETS

FIXTURE = Path(__file__).parent / "data" / "pair_run.json"


def _measured() -> dict:
    measured = json.loads(FIXTURE.read_text())
    measured["eval_rows"] = read_eval_rows(ASSETS / "eval.json")  # left out of the fixture: the shipped rows
    return measured


def test_the_recorded_pair_re_simulates_on_the_same_two_instances():
    measured = _measured()
    names = measured["info"]["instance_names"]
    assert names == ["tp1@0", "tp1@1"] and measured["info"]["instances"] == 2
    out = compare_with_sim(measured, seeds=2)
    assert len(out["rows"]) == len(measured["runs"]) == 2
    for row, run_ in zip(sorted(out["rows"], key=lambda r: r["policy"]),
                         sorted(measured["runs"], key=lambda r: r["policy"])):
        placed = row["placed"]
        assert sorted(placed["real"]) == sorted(placed["sim"]) == names  # both sides served on both instances
        assert sum(placed["real"].values()) == len(run_["trace"])
        assert sum(placed["sim"].values()) == pytest.approx(len(run_["trace"]))
        assert all(v > 0 for v in placed["sim"].values())
        assert row["real"] == summarize(run_["records"], duration=measured["info"]["duration"])


def test_each_simulated_engine_got_exactly_the_requests_the_router_placed_on_it():
    measured = _measured()
    step_time, latency, _ = step_time_model(measured)
    run_ = next(r for r in measured["runs"] if r["policy"] == "fcfs-static")
    st, host, own = run_inputs(measured, run_, step_time, "timeline", {}, "eval")
    sim = build_simulation(measured["info"], run_["policy"], run_["trace"], measured["items"], 0, step_time=st,
                           latency=latency, prior=None, eval_rows=measured["eval_rows"], traced=True, instances=2)
    res = sim.run()
    placed: dict[str, set] = {}
    for r in res.records:
        placed.setdefault(r.instance, set()).add(r.id)
    arrived = {name: {rid for rec in tr.records for rid, _ in rec.arrivals} for name, tr in sim.traces.items()}
    assert set(arrived) == {"tp1@0", "tp1@1"}
    assert arrived == placed  # no request moved: where it finished is where the router sent it
    assert sum(len(v) for v in placed.values()) == len(run_["trace"])


def test_one_simulated_instance_instead_of_two_is_told_apart():
    measured = _measured()
    two = compare_with_sim(measured, seeds=2)
    measured["info"]["instances"] = 1
    one = compare_with_sim(measured, seeds=2)
    assert all("placed" not in r for r in one["rows"])
    for a, b in zip(two["rows"], one["rows"]):  # at load 1.0 of two instances' capacity, one is overloaded
        assert b["sim"]["mean_latency"] > 1.5 * a["sim"]["mean_latency"]


def test_the_command_re_simulates_a_saved_pair_and_reports_per_policy_and_instance(tmp_path, capsys):
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(_measured()))
    args = ["--from", str(path), "--sim-seeds", "1", "--no-progress"]
    sims = []
    for _ in range(2):
        assert main([*args, "--json"]) == 0
        sims.append([(r["sim"], r["placed"]) for r in json.loads(capsys.readouterr().out)["rows"]])
    assert sims[0] == sims[1]  # deterministic
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "requests per instance" in text and "tp1@1 real" in text
    assert "dilaserve " in text and " of 1" in text and "of 2 in all" in text


def test_bad_instance_counts_are_refused(capsys, caplog):
    assert main(["--instances", str(len(pair.usable_cores()) + 1), "--no-progress"]) == 2  # before any model
    assert "pinned to its own core" in caplog.text
    assert main(["--instances", "0"]) == 2
    assert "instances" in capsys.readouterr().err


def test_xla_is_asked_for_the_devices_unless_told_otherwise(monkeypatch):
    monkeypatch.delitem(sys.modules, "jax", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    pair.prepare_devices(2)
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=2"
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    pair.prepare_devices(2)
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"  # the user's count stands


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no thread affinity on this OS")
def test_an_engine_thread_pins_itself_to_its_core():
    core = pair.usable_cores()[-1]
    seen = {}

    def work():
        seen["said"] = pair.pin_to_core(core)
        seen["now"] = os.sched_getaffinity(threading.get_native_id())

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen["now"] == {core} and "pinned to core" in seen["said"]
    assert len(os.sched_getaffinity(0)) == len(pair.usable_cores())  # the calling thread is left alone
