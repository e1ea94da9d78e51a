"""Fake-runner set-up shared by the serving tests (no JAX)."""
import pytest

from dilaserve_jax.serving.engine import Engine
from dilaserve_jax.serving.fake_runner import FakeClock, FakeRunner, fake_profile
from dilaserve_jax.serving.latency import LatencyModel
from dilaserve_jax.serving.request import Request
from dilaserve_jax.serving.scheduler import Scheduler, SchedulerConfig


@pytest.fixture(scope="session")
def latency():
    return LatencyModel.from_profile(fake_profile())


def make_engine(latency, slots=4, policy="dilaserve", difficulty=lambda p: 1.0, step_time=None, **cfg):
    clock = FakeClock()
    kw = {} if step_time is None else {"step_time": step_time}
    runner = FakeRunner(slots, clock, difficulty=difficulty, **kw)
    sched = Scheduler(SchedulerConfig(slots, policy=policy, **cfg), latency)
    return Engine(runner, sched, clock), clock


def req(id, now, slo, answer=64, block=16, prompt=32, tau_min=0.5, tau_max=1.0, first_token=1):
    return Request(id, (first_token,) + tuple(range(2, prompt + 1)), answer, block, now, now + slo,
                   tau_min=tau_min, tau_max=tau_max)
