"""Refinement by replay (sim/refine.py): a shortlisted layout is priced by replaying the window's
arrivals on it, held fixed, with the instance policy the run uses."""
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dilaserve_jax.serving.policy.controller import ControllerConfig
from dilaserve_jax.sim.refine import ReplayRefiner
from dilaserve_jax.sim.setup import setup_model
from dilaserve_jax.sim.simulator import SimConfig, Simulation, _shape
from dilaserve_jax.sim.slos import assign_slos
from dilaserve_jax.sim.workload import RequestSpec, arrival_times, build_shapes, load_trace, parse_slo

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "azure_llm_2023_code.csv"
pytestmark = pytest.mark.skipif(not TRACE.is_file(), reason=f"needs the code trace at {TRACE}")


@pytest.fixture(scope="module")
def llada():
    return setup_model("llada_8b", "h100")


def _sim(llada, rate, seconds, layout="auto", **ctl):
    rng = np.random.default_rng([0, 1])
    t = arrival_times(f"poisson:{rate}", duration=seconds, rate_scale=1.0, rng=rng)
    shapes = build_shapes("llada_8b", len(t), rng, trace=load_trace(TRACE), from_trace_rows=False,
                          max_len=llada.max_len)
    specs = assign_slos([RequestSpec(float(a), s.task, (0,) * s.prompt_len, s.answer_length, s.block_length,
                                     s.finish_tokens) for a, s in zip(t, shapes)],
                        parse_slo("idle:2,6"), quality=llada.quality, step_time=llada.step_time, tau=0.9, tp=1, seed=0)
    cfg = SimConfig(layout=layout, controller=replace(ControllerConfig(), **ctl))
    return Simulation(cfg, specs, step_time=llada.step_time, latency=llada.latency, quality=llada.quality,
                      prior=llada.prior, param_bytes=llada.param_bytes)


def test_a_replay_is_the_fixed_layout_run_of_the_window_and_ranks_an_overloaded_layout_last(llada):
    sim = _sim(llada, 50, 9.0)
    arrivals = [(s.arrival, _shape(s, sim.cfg)) for s in sim.specs if s.arrival >= 3.0]
    now = 9.0
    refiner = ReplayRefiner(sim)
    wide, narrow = refiner([(8,), (4, 4)], arrivals, now)
    assert refiner.replays == 2 and (wide.layout, narrow.layout) == ((8,), (4, 4))
    # at 50 req/s one TP-8 instance is far past its capacity, two TP-4 ones are not
    assert narrow.attainment > wide.attainment + 0.05 and narrow.latency_s < wide.latency_s
    # the replay is the 2x4 run of the same requests from t = 3 s, counted after the warm-up share
    start = arrivals[0][0]
    fixed = _sim(llada, 50, 9.0, layout="2x4")
    fixed.specs = [replace(s, arrival=s.arrival - start) for s in fixed.specs if s.arrival >= 3.0]
    counted = [r for r in fixed.run().records if r.arrival >= (now - start) * sim.cfg.controller.refine_warmup]
    assert narrow.attainment == pytest.approx(sum(r.met for r in counted) / len(counted))


def test_a_run_with_refinement_replays_and_loses_nothing(llada):
    sim = _sim(llada, 20, 24.0, refine_candidates=2, refine_every_s=20.0)
    res = sim.run()
    ctl = sim.cluster.autoscaler.controller
    assert len(res.records) == len(sim.specs) and ctl.refinement.refiner.replays >= 2 and ctl.refinement.seconds > 0
    replayed = [d for d in ctl.history if "by replay" in d.reason]
    assert replayed and all(len(d.predicted) <= 3 for d in replayed)  # the current layout and two more at most
