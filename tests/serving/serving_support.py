"""Fake-runner helpers shared by the serving tests (no JAX). A module name of its own: test
folders without __init__.py share one import namespace, where every "conftest" collides."""
from dilaserve_jax.serving.cluster.engine import Engine
from dilaserve_jax.serving.cluster.fake_runner import FakeClock, FakeRunner
from dilaserve_jax.serving.policy.request import Request
from dilaserve_jax.serving.policy.scheduler import Scheduler, SchedulerConfig


def make_engine(latency, slots=4, policy="dilaserve", difficulty=lambda p: 1.0, step_time=None, **cfg):
    clock = FakeClock()
    kw = {} if step_time is None else {"step_time": step_time}
    runner = FakeRunner(slots, clock, difficulty=difficulty, **kw)
    sched = Scheduler(SchedulerConfig(slots, policy=policy, **cfg), latency)
    return Engine(runner, sched, clock), clock


def req(id, now, slo, answer=64, block=16, prompt=32, tau_min=0.5, tau_max=1.0, first_token=1):
    return Request(id, (first_token,) + tuple(range(2, prompt + 1)), answer, block, now, now + slo,
                   tau_min=tau_min, tau_max=tau_max)
