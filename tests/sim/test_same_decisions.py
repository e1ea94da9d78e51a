"""The simulator and the real threaded Engine make the same decisions on the same request stream.

A deterministic fake runner (serving.cluster.fake_runner) stands in for the model in both. The threaded
side runs a started Engine on a FakeClock: arrivals that fall inside a step are submitted by a step
hook on the engine thread at the step's end (where a real engine would see them: at its next
iteration), and when the engine is idle a driver thread moves the clock to the next arrival and
submits it. The simulator replays the same stream through `Simulation`. Both record every step's
plan (time, kind, requests, τ, admissions) and every request's finish; they must be identical.
"""
import threading
import time

import numpy as np
import pytest

from dilaserve_jax.serving.cluster.engine import Engine
from dilaserve_jax.serving.cluster.fake_runner import FakeClock, FakeRunner, fake_profile
from dilaserve_jax.serving.policy.latency import LatencyModel
from dilaserve_jax.serving.policy.scheduler import Scheduler, SchedulerConfig
from dilaserve_jax.serving.policy.threshold import ThresholdConfig
from dilaserve_jax.sim.simulator import SimConfig, Simulation
from dilaserve_jax.sim.workload import RequestSpec

SLOTS = 4


def _difficulty(prompt):
    return 0.6 + (prompt[0] % 5) * 0.2  # varied per request, deterministic


def _specs(n=40, rate=30.0, seed=3):
    rng = np.random.default_rng(seed)
    t, out = 0.0, []
    for i in range(n):
        t += float(rng.exponential(1 / rate))
        answer, block = [(32, 16), (64, 16), (48, 16)][i % 3]
        prompt = tuple(int(x) for x in rng.integers(3, 100, size=int(rng.integers(8, 40))))
        out.append(RequestSpec(t, "fake", prompt, answer, block, slo=float(rng.uniform(0.05, 0.4))))
    return out


def _record(log):
    def hook(name, plan, outcomes, t0, t1):
        log.append((round(plan.time, 12), plan.kind, plan.request_ids, plan.taus,
                    tuple(a.request_id for a in plan.admits), round(t1, 12)))
    return hook


def _simulated(policy, specs, latency):
    log = []
    sim = Simulation(SimConfig(devices=1, policy=policy, layout="1x1", slots=SLOTS), specs, step_time=None,
                     latency=latency, quality=None, prior=None, param_bytes=0.0,
                     runner_factory=lambda info, clock: FakeRunner(SLOTS, clock, difficulty=_difficulty))
    sim.hooks.append(_record(log))
    res = sim.run()
    finish = {r.id: (r.state, None if r.finish is None else round(r.finish, 12)) for r in res.records}
    return log, finish, sim


def _threaded(policy, specs, latency, sim):
    clock = FakeClock()
    runner = FakeRunner(SLOTS, clock, difficulty=_difficulty)
    engine = Engine(runner, Scheduler(SchedulerConfig(SLOTS, policy=policy, threshold=ThresholdConfig()), latency),
                    clock=clock, name="tp1@0")
    log, handles = [], {}
    reqs = [sim.make_request(i) for i in range(len(specs))]
    nxt = [0]
    lock = threading.Lock()

    def submit_due(now):
        with lock:
            while nxt[0] < len(reqs) and reqs[nxt[0]].arrival <= now:
                r = reqs[nxt[0]]
                handles[r.id] = engine.submit(r)
                nxt[0] += 1

    engine.add_step_hook(_record(log))
    engine.add_step_hook(lambda name, plan, outs, t0, t1: submit_due(t1))  # arrivals during the step
    engine.start()
    try:
        deadline = time.monotonic() + 60
        while True:
            with lock:
                left = nxt[0] < len(reqs)
            if not left:
                break
            # idle: nothing running or queued and no mailbox ops; then the next arrival comes in
            while not (engine.scheduler.idle and not engine._ops):
                assert time.monotonic() < deadline, "threaded engine did not go idle"
                time.sleep(0.001)
            engine.call(lambda: None).result(10)
            if not engine.scheduler.idle:
                continue
            with lock:
                if nxt[0] >= len(reqs):
                    break
                clock.advance(max(0.0, reqs[nxt[0]].arrival - clock()))
            submit_due(clock())
        results = {rid: h.result(30) for rid, h in handles.items()}
    finally:
        engine.stop()
    finish = {rid: (r.state.name, None if r.finish is None else round(r.finish, 12)) for rid, r in results.items()}
    return log, finish


@pytest.mark.parametrize("policy", ["dilaserve", "fcfs-static", "edf-static"])
def test_simulator_and_threaded_engine_decide_alike(policy):
    latency = LatencyModel.from_profile(fake_profile())
    specs = _specs()
    sim_log, sim_finish, sim = _simulated(policy, specs, latency)
    real_log, real_finish = _threaded(policy, specs, latency, sim)
    assert len(sim_log) > 50
    assert sim_log == real_log
    assert sim_finish == real_finish
    # the stream exercised the policy: batches of several requests, and (dilaserve) more than one τ
    assert max(len(e[2]) for e in sim_log) > 1
    if policy == "dilaserve":
        assert len({t for e in sim_log for t in e[3]}) > 1


def test_a_different_stream_is_told_apart():
    """The comparison can fail: one request arriving a few steps later changes the decisions."""
    latency = LatencyModel.from_profile(fake_profile())
    specs = _specs()
    log_a, _, _ = _simulated("dilaserve", specs, latency)
    moved = list(specs)
    moved[5] = RequestSpec(specs[5].arrival + 0.02, *[getattr(specs[5], f) for f in
                                                      ("task", "prompt_tokens", "answer_length", "block_length",
                                                       "finish_tokens", "slo")])
    log_b, _, _ = _simulated("dilaserve", moved, latency)
    assert log_a != log_b
