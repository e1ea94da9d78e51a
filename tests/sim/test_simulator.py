"""The simulator end to end: switches and migrations charged and accounted, determinism, ablations, CLI."""
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dilaserve_jax.core.layouts import moved_fraction, received_per_device
from dilaserve_jax.serving.policy.controller import ControllerConfig
from dilaserve_jax.serving.cluster.fake_runner import FakeRunner, fake_tp_profile
from dilaserve_jax.serving.policy.latency import LatencyModel
from dilaserve_jax.sim.cluster import ARRIVAL, CONTROL, SimBuilder, SwitchCost, instance_infos
from dilaserve_jax.sim.report import summarize
from dilaserve_jax.sim.setup import setup_model
from dilaserve_jax.sim.simulator import SimConfig, Simulation
from dilaserve_jax.sim.workload import RequestSpec, arrival_times, build_shapes


def _llada_specs(rate, duration, seed=0, slo=1.0):
    rng = np.random.default_rng(seed)
    t = arrival_times(f"poisson:{rate}", duration=duration, rate_scale=1.0, rng=rng)
    shapes = build_shapes("llada_8b", len(t), rng, trace=None, from_trace_rows=False, fixed=(600, 90))
    return [RequestSpec(float(a), s.task, (0,) * s.prompt_len, s.answer_length, s.block_length, s.finish_tokens, slo)
            for a, s in zip(t, shapes)]


@pytest.fixture(scope="module")
def llada():
    return setup_model("llada_8b", "h100")


def _sim(llada, specs, **cfg):
    return Simulation(SimConfig(**cfg), specs, step_time=llada.step_time, latency=llada.latency,
                      quality=llada.quality, prior=llada.prior, param_bytes=llada.param_bytes)


def test_switch_cost_is_bytes_into_the_busiest_device_plus_compiles():
    for old, new in [((8,), (4, 4)), ((4, 4), (1,) * 8), ((2, 2, 2, 2), (4, 2, 1, 1)), ((8,), (8,))]:
        assert sum(received_per_device(old, new)) == pytest.approx(moved_fraction(old, new))
    cost = SwitchCost(param_bytes=16e9, bandwidth_gbps=100.0, compile_s=10.0)
    seconds, moved, compiled = cost.seconds((8,), (1,) * 8, frozenset())
    # each device needs a whole copy and holds 1/8 of it; 8 placements never compiled
    assert moved == pytest.approx(7 * 16e9) and compiled == 8
    assert seconds == pytest.approx(7 / 8 * 16e9 / 100e9 + 80.0)
    seconds, _, compiled = cost.seconds((8,), (1,) * 8, frozenset((1, d) for d in range(8)))
    assert compiled == 0 and seconds == pytest.approx(7 / 8 * 16e9 / 100e9)
    assert [i.name for i in instance_infos("4+2+1+1", 8)] == ["tp4@0-3", "tp2@4-5", "tp1@6", "tp1@7"]
    with pytest.raises(ValueError):
        instance_infos("2x4", 16)


def test_a_gpu_compile_cache_compiles_each_degree_once_and_builds_each_new_instance():
    cost = SwitchCost(param_bytes=16e9, bandwidth_gbps=100.0, compile_s=10.0, load_s=1.0)
    move = 7 / 8 * 16e9 / 100e9
    per_placement = SimBuilder(8)
    per_placement.compiled.add((1, 0))
    seconds, _, compiled = cost.seconds((8,), (1,) * 8, per_placement.compiled_placements())
    assert compiled == 7 and seconds == pytest.approx(move + 8 * 1.0 + 7 * 10.0)
    by_degree = SimBuilder(8, by_degree=True)
    by_degree.compiled.add((1, 0))
    seconds, _, compiled = cost.seconds((8,), (1,) * 8, by_degree.compiled_placements())
    assert compiled == 0 and seconds == pytest.approx(move + 8 * 1.0)
    _, _, compiled = cost.seconds((8,), (2,) * 4, by_degree.compiled_placements())
    assert compiled == 4  # a degree never compiled compiles at each new placement


def _burst(quiet_s, rate, burst_s):
    """Light load, then far more than one wide instance serves."""
    return _llada_specs(3, quiet_s) + [RequestSpec(quiet_s + s.arrival, *[getattr(s, f) for f in (
        "task", "prompt_tokens", "answer_length", "block_length", "finish_tokens", "slo")])
        for s in _llada_specs(rate, burst_s, seed=1)]


FAST_CONTROL = ControllerConfig(interval_s=0.5, window_s=4.0, min_dwell_s=2.0, compile_s=0.5, load_s=0.25)


@pytest.mark.slow
def test_reconfiguration_under_rising_load_moves_requests_and_loses_none(llada):
    specs = _burst(10, 150, 3)
    ctl = FAST_CONTROL
    res = _sim(llada, specs, devices=8, policy="dilaserve", layout="auto", initial_layout="1x8", controller=ctl).run()
    assert len(res.records) == len(specs) and len({r.id for r in res.records}) == len(specs)
    assert all(r.state in ("FINISHED_OK", "FINISHED_REJECTED") for r in res.records)
    # the burst moves it off the single wide instance (it may come back once the burst has drained)
    assert res.reconfigurations and res.layouts[0][1] == "1x8" and res.layouts[1][1] != "1x8"
    first = res.reconfigurations[0]
    # charged: the switch completes its modelled cost (bytes into the busiest device, compiles) after the decision
    # by default every candidate TP degree was compiled before serving: each new instance is only built
    assert first.compiled == 0 and first.switch_s > 0.25 * len(first.added)
    assert first.finished - first.started == pytest.approx(first.switch_s)
    moved = [r for r in res.records if r.moves]
    assert moved and sum(r.requests_moved for r in res.reconfigurations) == res.migrations["reconfigure"] == \
        sum(r.moves for r in moved)
    assert all(r.finish >= r.arrival for r in res.records if r.finish is not None)


@pytest.mark.slow
def test_without_reconfiguration_the_layout_stays(llada):
    res = _sim(llada, _burst(10, 150, 3), devices=8, policy="dilaserve", layout="auto", initial_layout="1x8",
               ablate=frozenset({"reconfig"}), controller=FAST_CONTROL).run()
    assert not res.reconfigurations and res.layouts == [(0.0, "1x8")]


@pytest.mark.parametrize("policy", ["dilaserve", "fcfs-static"])
def test_a_schedule_switches_at_its_times_whatever_the_load(llada, policy):
    specs = _llada_specs(5, 12.0)
    res = _sim(llada, specs, devices=8, policy=policy, layout="schedule:1x8@0,4x2@4,2x4@8").run()
    assert [lay for _, lay in res.layouts] == ["1x8", "4x2", "2x4"]
    assert [r.reason for r in res.reconfigurations] == ["schedule", "schedule"]
    starts = [r.started for r in res.reconfigurations]
    # the second waits for the first to end if it has not
    assert starts[0] == pytest.approx(4.0) and 8.0 <= starts[1] < max(8.0, res.reconfigurations[0].finished) + 0.3
    assert len(res.records) == len(specs) and all(r.finish is not None for r in res.records)


@pytest.mark.parametrize("bad", ["schedule:", "schedule:1x8@5", "schedule:1x8@0,2x4@0", "schedule:1x8@0,2x4",
                                 "schedule:1x8@0,3x3@5", "schedule:1x8@0,2x4@x"])
def test_a_malformed_schedule_is_refused_with_its_form(bad):
    with pytest.raises(ValueError, match="LAYOUT@SECONDS|mesh|device"):
        SimConfig(devices=8, layout=bad)


def _two_on_one(ablate=frozenset()):
    """Two requests at once on two idle single-slot-pair instances: the router breaks the tie towards the
    first instance for both; together there they cannot both meet the SLO, alone each can."""
    latency = LatencyModel.from_profile(fake_tp_profile(tps=(1,)))
    specs = [RequestSpec(0.0, "fake", tuple(range(k, 37 + k)), 64, 16, slo=0.04) for k in (3, 4)]
    log = []
    sim = Simulation(SimConfig(devices=2, policy="dilaserve", layout="2x1", slots=2, tp_degrees=(1,), ablate=ablate,
                               controller=ControllerConfig(interval_s=0.002, migration_cooldown_s=0.05)),
                     specs, step_time=None, latency=latency, quality=None, prior=None, param_bytes=0.0,
                     runner_factory=lambda info, clock: FakeRunner(2, clock))
    sim.hooks.append(lambda name, plan, outs, t0, t1: log.append((name, plan.kind, plan.request_ids)))
    return sim.run(), log


def test_an_at_risk_request_migrates_to_a_spare_instance_and_restarts_with_a_refresh():
    res, log = _two_on_one()
    assert len(res.records) == 2 and res.migrations == {"at risk": 1}
    moved = [r for r in res.records if r.moves]
    assert len(moved) == 1 and moved[0].instance == "tp1@1"
    steps_there = [k for name, k, ids in log if name == "tp1@1"]
    assert steps_there and int(steps_there[0]) == 0  # REFRESH: its K/V is rebuilt where it landed
    assert all(r.met for r in res.records)
    res, _ = _two_on_one(frozenset({"migration"}))
    assert not res.migrations and not any(r.moves for r in res.records)
    assert sum(r.met for r in res.records) < 2


def test_same_seed_same_run_and_another_seed_differs(llada):
    specs = _llada_specs(20, 5)
    a = _sim(llada, specs, devices=8, policy="dilaserve", layout="auto", seed=3).run()
    b = _sim(llada, specs, devices=8, policy="dilaserve", layout="auto", seed=3).run()
    assert a.records == b.records and a.layouts == b.layouts
    noisy = llada.step_time.__class__(**{**{f: getattr(llada.step_time, f) for f in
                                             ("latency", "table", "batch_buckets", "length_buckets", "overhead_s")},
                                          "noise": 0.3})
    c = Simulation(SimConfig(devices=8, policy="dilaserve", layout="auto", seed=3), specs, step_time=noisy,
                   latency=llada.latency, quality=llada.quality, prior=llada.prior, param_bytes=llada.param_bytes).run()
    d = Simulation(SimConfig(devices=8, policy="dilaserve", layout="auto", seed=4), specs, step_time=noisy,
                   latency=llada.latency, quality=llada.quality, prior=llada.prior, param_bytes=llada.param_bytes).run()
    assert c.records != d.records


@pytest.mark.slow
def test_ablations_change_how_tau_is_chosen(llada):
    specs = _llada_specs(60, 3, slo=0.6)
    taus = {}
    for ablate in ((), ("threshold",), ("load",), ("threshold", "load")):
        res = _sim(llada, specs, devices=8, policy="dilaserve", layout="2x4", ablate=frozenset(ablate)).run()
        s = summarize(res.records)
        taus[ablate] = s["mean_tau"]
    assert taus[("threshold", "load")] == pytest.approx(0.9)  # every request at its τ_max
    assert taus[()] < 0.9 and len({round(v, 4) for v in taus.values()}) >= 3
    with pytest.raises(ValueError, match="fixed --layout"):
        SimConfig(policy="fcfs-static", layout="auto")
    with pytest.raises(ValueError, match="unknown ablations"):
        SimConfig(ablate=frozenset({"everything"}))


def test_sim_imports_and_runs_without_jax(tmp_path):
    code = textwrap.dedent("""
        import sys, importlib, importlib.abc
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('jax', 'jaxlib', 'flax'):
                    raise ImportError('blocked: ' + name)
        sys.meta_path.insert(0, Block())
        for m in ('cluster', 'executor', 'policies', 'quality', 'report', 'setup', 'simulator', 'workload',
                  '__main__'):
            importlib.import_module('dilaserve_jax.sim.' + m)
        from dilaserve_jax.sim.__main__ import main
        assert main(['--trace', 'poisson:5', '--duration', '5', '--devices', '4', '--no-progress', '--json']) == 0
        bad = [m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')]
        assert not bad, bad
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)["report"]
    assert report["requests"] > 5 and report["devices"] == 4


def test_cli_reports_and_refuses_bad_input(tmp_path, capsys):
    from dilaserve_jax.serving.cluster.fake_runner import fake_profile
    from dilaserve_jax.sim.__main__ import main

    csv = tmp_path / "trace.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:17:{i // 10:02d}.{i % 10}000000,{100 + 37 * i},{5 + (i * 7) % 40}\n" for i in range(40)))
    records = tmp_path / "r.jsonl"
    assert main(["--trace", str(csv), "--devices", "8", "--policy", "fcfs-static", "--layout", "2x4",
                 "--records", str(records), "--no-progress", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["report"]
    assert report["requests"] == 40 == len(records.read_text().splitlines())
    assert report["system"] == "fcfs-static 2x4" and report["mean_tau"] == pytest.approx(0.9)
    # the tiny model from a measured-format profile (the fake runner's) and the shipped eval rows
    prof = tmp_path / "profile.json"
    fake_profile(canvases=(64, 128, 256)).save(prof)
    assert main(["--model", "tiny", "--profile", str(prof), "--trace", "poisson:20", "--duration", "3",
                 "--devices", "1", "--layout", "1", "--no-progress"]) == 0
    assert "SLO %" in capsys.readouterr().out
    assert main(["--policy", "edf-static", "--no-progress"]) == 2  # static policies need a layout
    assert main(["--trace", "poisson:2", "--no-progress"]) == 2  # synthetic arrivals need a duration
    assert main(["--model", "tiny", "--trace", "poisson:2", "--duration", "1"]) == 2  # tiny needs a profile
    assert main(["--trace", str(tmp_path / "missing.csv")]) == 2
    err = capsys.readouterr().err
    assert "needs a fixed --layout" in err and "positive --duration" in err and "--profile" in err


def test_control_rounds_stop_when_the_work_is_done(llada):
    specs = _llada_specs(5, 4)
    sim = _sim(llada, specs, devices=4, policy="dilaserve", layout="auto")
    res = sim.run()
    assert not sim.cluster._events and res.sim_s < specs[-1].arrival + 10
    assert ARRIVAL < CONTROL


def test_a_request_lost_by_the_cluster_stops_the_run_with_its_id(llada, monkeypatch):
    # a request on no instance would keep the control rounds ticking forever
    from dilaserve_jax.sim.cluster import SimCluster

    specs = _llada_specs(5, 4)
    sim = _sim(llada, specs, devices=2, policy="dilaserve", layout="2x1", tp_degrees=(1,))
    placed = SimCluster._place

    def drop_one(self, req, future, *a, **k):
        if req.id == "r3":  # accepted, then never queued anywhere
            self.where[req.id] = "nowhere"
            return "nowhere"
        return placed(self, req, future, *a, **k)

    monkeypatch.setattr(SimCluster, "_place", drop_one)
    with pytest.raises(RuntimeError, match=r"stalled .* 1 request\(s\) unfinished .*r3"):
        sim.run()


def test_the_step_counts_add_up_to_the_requests_steps(llada, capsys):
    from dilaserve_jax.core.kinds import StepKind
    from dilaserve_jax.sim.__main__ import main

    res = _sim(llada, _llada_specs(20, 4), devices=8, policy="fcfs-static", layout="2x4").run()
    stats = res.step_stats
    assert {tp for tp, _ in stats.counts} == {4}
    ok = [r for r in res.records if r.state == "FINISHED_OK"]
    assert len(ok) == len(res.records) > 40
    # every step a request took was counted once in a batch, and only those
    assert sum(c.requests for c in stats.counts.values()) == sum(r.steps for r in ok)
    refresh, reuse = stats.counts[4, StepKind.REFRESH], stats.counts[4, StepKind.REUSE]
    assert refresh.steps and reuse.steps and 1.0 <= refresh.mean_batch <= 8 and 1.0 <= reuse.mean_batch <= 8
    assert stats.busy_s() == pytest.approx(refresh.seconds + reuse.seconds) and stats.busy_s() > 0
    out = stats.to_json(len(ok))
    assert out["by_tp"]["4"]["reuse"]["steps"] == reuse.steps
    assert out["step_s_per_finished"] == pytest.approx(stats.busy_s() / len(ok))
    assert main(["--trace", "poisson:5", "--duration", "3", "--devices", "4", "--layout", "4x1", "--no-progress"]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("steps: ")]
    assert len(line) == 1 and "TP 1 " in line[0] and "step-s per finished request" in line[0]
