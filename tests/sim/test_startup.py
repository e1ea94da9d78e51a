"""Start-up and a fast ramp in simulation: the controller as shipped (default flags) on 8 modelled
H100s, Poisson arrivals with the code trace's lengths jumping from 5 to 90 req/s, decides for the
layout a steady 90 req/s run is on within one dwell time of the jump, with no detour on the way."""
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dilaserve_jax.core.layouts import layout_text
from dilaserve_jax.serving.policy.controller import ControllerConfig
from dilaserve_jax.sim.setup import setup_model
from dilaserve_jax.sim.simulator import SimConfig, Simulation
from dilaserve_jax.sim.slos import assign_slos
from dilaserve_jax.sim.workload import RequestSpec, arrival_times, build_shapes, load_trace, parse_slo

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "azure_llm_2023_code.csv"
pytestmark = pytest.mark.skipif(not TRACE.is_file(), reason=f"needs the code trace at {TRACE}")


@pytest.fixture(scope="module")
def llada():
    return setup_model("llada_8b", "h100")


def _specs(llada, spec, duration=None):
    rng = np.random.default_rng([0, 1])
    t = arrival_times(spec, duration=duration, rate_scale=1.0, rng=rng)
    shapes = build_shapes("llada_8b", len(t), rng, trace=load_trace(TRACE), from_trace_rows=False,
                          max_len=llada.max_len)
    specs = [RequestSpec(float(a), s.task, (0,) * s.prompt_len, s.answer_length, s.block_length, s.finish_tokens)
             for a, s in zip(t, shapes)]
    return assign_slos(specs, parse_slo("idle:2,6"), quality=llada.quality, step_time=llada.step_time, tau=0.9, tp=1,
                       seed=0)


def _sim(llada, specs, **ctl):
    cfg = SimConfig(controller=replace(ControllerConfig(), **ctl))
    return Simulation(cfg, specs, step_time=llada.step_time, latency=llada.latency, quality=llada.quality,
                      prior=llada.prior, param_bytes=llada.param_bytes)


def test_a_fast_ramp_reaches_the_steady_layout_within_one_dwell(llada):
    dwell = ControllerConfig().min_dwell_s
    # the layout a steady 90 req/s run starts on (the prediction for its first window)
    steady_sim = _sim(llada, _specs(llada, "poisson:90", duration=30.0))
    steady = steady_sim.initial_layout()
    low = _sim(llada, _specs(llada, "poisson:5", duration=30.0)).initial_layout()
    assert steady != low  # the ramp does ask for another layout
    jump = 30.0
    sim = _sim(llada, _specs(llada, f"steps:5@{jump:g},90@{dwell - 4:g}"))
    res = sim.run()
    assert res.layouts[0][1] == low  # the start layout: the prediction for the first window (5 req/s)
    history = list(sim.cluster.autoscaler.controller.history)
    switches = [d for d in history if d.switch]
    assert switches, [str(d) for d in history[-5:]]
    first = switches[0]
    # the first switch goes straight to the steady layout (no intermediate layout then a dwell), and is
    # decided within one dwell time of the jump; the reconfiguration the cluster runs is that one. At
    # 90 req/s several partitions are predicted within a point of each other (8x1, 2+2+1+1+1+1,
    # 2+1+1+1+1+1+1), so "the steady layout" is any the steady run's own first prediction ranks
    # level with it (an intermediate layout, fit for the lagging window's rate, is far below there)
    assert jump < first.time <= jump + dwell, str(first)
    if first.chosen != steady:
        at_steady = {layout_text(p.layout): p.attainment for p in steady_sim.first_window_predictions()[1]}
        assert at_steady[steady] - at_steady[first.chosen] <= 0.01, (str(first), at_steady)
    assert [(r.old, r.new) for r in res.reconfigurations][:1] == [(low, first.chosen)]
    # before the window caught up with the ramp, the controller said why it waited
    assert any("load still changing" in d.reason for d in history if jump < d.time < first.time)
    # nothing decided before the estimate was trusted (a full window, min_arrivals): no switch before `jump`
    assert all(not d.switch for d in history if d.time <= ControllerConfig().window_s)
