"""Iteration traces: the real engine (driven as the validation benchmark drives it, on the fake runner and
a fake clock) and the simulator record the same iterations on the same arrivals, and a comparison
tells one perturbed arrival apart."""
import numpy as np
import pytest

from dilaserve_jax.serving.cluster.engine import Engine
from dilaserve_jax.serving.cluster.fake_runner import FakeClock, FakeRunner, fake_profile
from dilaserve_jax.serving.cluster.iteration_trace import IterationRecord, IterationTracer
from dilaserve_jax.serving.policy.latency import LatencyModel
from dilaserve_jax.serving.policy.scheduler import Scheduler, SchedulerConfig
from dilaserve_jax.serving.policy.threshold import ThresholdConfig
from dilaserve_jax.sim.simulator import SimConfig, Simulation
from dilaserve_jax.sim.trace_compare import first_divergence, format_comparison, normalized
from dilaserve_jax.sim.workload import RequestSpec

SLOTS = 4


def _difficulty(prompt):
    return 0.6 + (prompt[0] % 5) * 0.2


def _specs(n=30, rate=30.0, seed=5):
    rng = np.random.default_rng(seed)
    t, out = 0.0, []
    for i in range(n):
        t += float(rng.exponential(1 / rate))
        answer, block = [(32, 16), (64, 16), (48, 16)][i % 3]
        prompt = tuple(int(x) for x in rng.integers(3, 100, size=int(rng.integers(8, 40))))
        out.append(RequestSpec(t, "fake", prompt, answer, block, slo=float(rng.uniform(0.05, 0.4))))
    return out


def _simulated(policy, specs, latency):
    sim = Simulation(SimConfig(devices=1, policy=policy, layout="1x1", slots=SLOTS), specs, step_time=None,
                     latency=latency, quality=None, prior=None, param_bytes=0.0, trace=True,
                     runner_factory=lambda info, clock: FakeRunner(SLOTS, clock, difficulty=_difficulty))
    sim.run()
    (tracer,) = sim.traces.values()
    return sim, tracer.records


def _real(policy, specs, latency, sim, shift=None):
    """The engine driven as `Bench.serve` drives it: arrivals due are submitted before each
    iteration; an idle engine's clock jumps to the next arrival; the last releases are flushed. `shift`: (index, seconds) moves
    one arrival."""
    clock = FakeClock()
    engine = Engine(FakeRunner(SLOTS, clock, difficulty=_difficulty),
                    Scheduler(SchedulerConfig(SLOTS, policy=policy, threshold=ThresholdConfig()), latency),
                    clock=clock, name="tp1@0")
    engine.tracer = tracer = IterationTracer(clock)
    reqs = [sim.make_request(i) for i in range(len(specs))]
    if shift is not None:
        i, dt = shift
        reqs[i].arrival += dt
        reqs[i].deadline += dt
    reqs.sort(key=lambda r: r.arrival)
    handles, nxt = [], 0
    while nxt < len(reqs) or not all(h.done() for h in handles):
        while nxt < len(reqs) and clock() >= reqs[nxt].arrival:
            handles.append(engine.submit(reqs[nxt]))
            nxt += 1
        if not engine.step_once() and nxt < len(reqs):
            clock.advance(max(0.0, reqs[nxt].arrival - clock()))
    while engine.step_once():  # the last releases, as the benchmark flushes them
        pass
    return tracer.records


@pytest.mark.parametrize("policy", ["dilaserve", "edf-static"])
def test_real_engine_and_simulator_record_identical_iterations(policy):
    latency = LatencyModel.from_profile(fake_profile())
    specs = _specs()
    sim, simulated = _simulated(policy, specs, latency)
    real = _real(policy, specs, latency, sim)
    assert len(real) > 40 and max(len(r.batch) for r in real) > 1
    assert first_divergence(normalized(real), normalized(simulated)) is None
    assert [r.decisions() for r in normalized(real)] == [r.decisions() for r in normalized(simulated)]
    # every request arrives once, and each record's host phases were timed
    assert sorted(rid for r in real for rid, _ in r.arrivals) == sorted(f"r{i}" for i in range(len(specs)))
    assert all(set(r.phases) >= {"mailbox", "schedule", "publish"} and r.host_s >= 0 for r in real)
    assert "the traces are identical" in format_comparison(normalized(real), normalized(simulated), lambda r: 1.0)


def test_one_perturbed_arrival_is_detected_where_it_arrives():
    latency = LatencyModel.from_profile(fake_profile())
    specs = _specs()
    sim, simulated = _simulated("dilaserve", specs, latency)
    moved = 12
    real = _real("dilaserve", specs, latency, sim, shift=(moved, 0.004))
    div = first_divergence(normalized(real), normalized(simulated))
    assert div is not None
    # nothing differs before the iteration where it arrives in the simulation, and there it is missing
    arrived_at = next(i for i, r in enumerate(simulated) if any(rid == f"r{moved}" for rid, _ in r.arrivals))
    assert (div.index, div.what) == (arrived_at, "arrivals") and div.sim == (str(moved),) and div.real == ()


def test_records_round_trip_through_json():
    latency = LatencyModel.from_profile(fake_profile())
    _, records = _simulated("edf-static", _specs(n=8), latency)
    back = [IterationRecord.from_json(r.to_json()) for r in records]
    assert [r.decisions() for r in back] == [r.decisions() for r in records]
    assert [r.phases for r in back] == [r.phases for r in records]
