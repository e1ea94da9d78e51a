"""The soak benchmark end to end, small: a fault and a reload midway, and no call lost."""
import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_soak_loses_nothing(tmp_path):
    from dilaserve_jax.serving.cluster.fake_runner import fake_profile

    fake_profile().save(tmp_path / "profile.json")  # skip the start-up measurement: answers do not depend on it
    out = subprocess.run([sys.executable, "-m", "dilaserve_jax.bench.soak", "--requests", "60", "--concurrency", "16",
                          "--mesh", "2x1", "--slots", "4", "--compile-cache", str(tmp_path / "xla"), "--json",
                          "--profile", str(tmp_path / "profile.json")],
                         capture_output=True, text=True, timeout=600,
                         env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})  # it presents its own
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["lost"] == 0 and report["calls"] == 60
    assert report["completed"] + report["rejected_by_design"] + report["cancelled"] == 60
    assert report["completed"] > 30 and report["reloads"] == 1
    assert list(report["failures"]) == ["tp1@0"]
    assert report["rebuilt"] == [["tp1@0", "rebuilt"]]  # the failed instance serves again


def test_phases_parse_and_draw_poisson_arrivals_per_phase():
    import argparse

    from dilaserve_jax.bench.soak import parse_phases, poisson_arrivals

    phases = parse_phases("2:60, 30:60")
    assert phases == ((2.0, 60.0), (30.0, 60.0))
    for bad in ("", "2", "2:0", "-1:5", "a:b"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_phases(bad)
    times = poisson_arrivals(phases, seed=0)
    assert times == sorted(times) and times == poisson_arrivals(phases, seed=0)
    low = sum(t < 60 for t in times)
    high = len(times) - low
    assert 80 <= low <= 170 and 1500 <= high <= 2100  # 120 and 1800 expected
    assert max(times) < 120


def test_the_switching_pattern_makes_the_controller_switch_three_times():
    """The documented `--phases 1:60,10:60,... --layouts 4x2,2x4,1x8 --profile synthetic-tp
    --slo-ms 2500` soak (four phases), priced as the server prices it (default config, the tiny
    model's TP degrees, 8 slots, the shipped eval rows' τ prior, τ down to 0.9, the decoder's
    buckets) on the soak's request shape: it must give the live controller at least three switches
    to make."""
    from pathlib import Path

    from dilaserve_jax.bench.soak import parse_phases, poisson_arrivals, synthetic_tp_profile
    from dilaserve_jax.core.layouts import layout_text, parse_layout
    from dilaserve_jax.serving.policy.capacity import RequestShape, StepShapes
    from dilaserve_jax.serving.policy.controller import ClusterController, ControllerConfig
    from dilaserve_jax.serving.policy.eval_rows import prior_from_eval_json
    from dilaserve_jax.serving.policy.latency import LatencyModel

    latency = LatencyModel.from_profile(synthetic_tp_profile())
    prior = prior_from_eval_json(Path(__file__).resolve().parents[1] / "dilaserve_jax" / "assets" / "tiny" / "eval.json")
    ctl = ClusterController(ControllerConfig(), num_devices=8, tp_degrees=(1, 2, 4, 8), latency=latency, slots=8,
                            param_bytes=10**7, layouts=("4x2", "2x4", "1x8"), tau_floor=0.9, prior=prior,
                            shapes=StepShapes((128, 256), (1, 2, 4, 8)))
    shape = RequestShape(12, 12, 12, 2.5, 0.9, 1.0)
    arrivals = iter(poisson_arrivals(parse_phases("1:60,10:60,1:60,10:60"), seed=0))
    layout, seen, now, nxt = (4, 4), ["2x4"], 0.0, next(arrivals)
    while now < 240.0:
        while nxt is not None and nxt <= now:
            ctl.observe(shape, nxt)
            nxt = next(arrivals, None)
        d = ctl.decide(now, layout)
        if d.switch:
            layout = parse_layout(d.chosen)
            ctl.switched(now)
            seen.append(layout_text(layout))
        now += ctl.cfg.interval_s
    assert len(seen) >= 4, seen
    widths = [len(parse_layout(s)) for s in seen]
    assert all((a - b) * (b - c) < 0 for a, b, c in zip(widths, widths[1:], widths[2:])), seen  # back and forth
