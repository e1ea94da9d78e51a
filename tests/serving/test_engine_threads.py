import threading
import time

from serving_support import make_engine, req
from dilaserve_jax.serving.cluster.cluster import Cluster, InstanceInfo
from dilaserve_jax.serving.cluster.engine import Engine
from dilaserve_jax.serving.cluster.timeline import StepTimeline
from dilaserve_jax.serving.cluster.fake_runner import FakeRunner
from dilaserve_jax.serving.policy.request import Request, RequestState
from dilaserve_jax.serving.policy.router import Router, predict_finish
from dilaserve_jax.serving.policy.scheduler import Scheduler, SchedulerConfig


def test_submit_future_and_progress_callbacks(latency):
    engine, clock = make_engine(latency)
    seen = []
    h = engine.submit(req("a", 0.0, 10.0, answer=32), on_progress=seen.append)
    engine.run_until_idle()
    res = h.result(0)
    assert res.state == RequestState.FINISHED_OK and len(res.tokens) == 32
    assert [p.committed for p in seen] == sorted(p.committed for p in seen) and seen[-1].committed == 32
    answer = [None] * 32
    for p in seen:
        for pos, tok in zip(p.positions, p.tokens):
            answer[pos] = tok
    assert tuple(answer) == res.tokens  # the stream rebuilds the final answer


def _sleepy_engine(latency, name, step_s):
    runner = FakeRunner(2, step_time=lambda k, b, l, blk: step_s, real_sleep=True)
    return Engine(runner, Scheduler(SchedulerConfig(2), latency), clock=time.monotonic, name=name)


def test_two_instances_overlap_in_threads(latency):
    step_s, n = 0.02, 8  # τ = 1.0, 8 tokens: exactly 8 steps per instance
    engines = [_sleepy_engine(latency, f"i{k}", step_s) for k in range(2)]
    timeline = StepTimeline()
    for e in engines:
        e.add_step_hook(timeline)
    for e in engines:
        e.start()
    try:
        t0 = time.monotonic()
        hs = [e.submit(Request(f"r{k}", (1, 2), n, n, t0, t0 + 60, tau_min=1.0, tau_max=1.0))
              for k, e in enumerate(engines)]
        results = [h.result(timeout=10) for h in hs]
        wall = time.monotonic() - t0
    finally:
        for e in engines:
            e.stop()
    assert all(r.steps == n for r in results)
    serial = 2 * n * step_s
    assert wall < 0.8 * serial, f"{wall:.3f}s: instances did not overlap (serial would be {serial:.3f}s)"
    assert timeline.overlap("i0", "i1") > 0.4 * n * step_s


def test_router_sends_to_earliest_predicted_finish(latency):
    busy, free = _sleepy_engine(latency, "busy", 0.0), _sleepy_engine(latency, "free", 0.0)
    cluster = Cluster([busy, free], [InstanceInfo("busy", 1, (0,)), InstanceInfo("free", 1, (1,))], layout="2x1",
                      policy="dilaserve", model_source="fake", tokenizer=None, limits=None, step_timeout_s=None)
    cluster.ready = True
    for i in range(4):  # not started: submissions stay queued on the busy one
        busy.submit(req(f"b{i}", time.monotonic(), 60.0))
    now = time.monotonic()
    x = req("x", now, 60.0)
    assert predict_finish(busy.snapshot(), x, now) > predict_finish(free.snapshot(), x, now)
    cluster.submit(req("new", time.monotonic(), 60.0))
    assert cluster.instance_of("new") == "free"
    assert cluster.abort("new") and not cluster.abort("unknown")
    assert Router().choose([busy.snapshot(), free.snapshot()], x, now, exclude=frozenset({"free"})) == "busy"


def test_abort_from_another_thread(latency):
    engine = _sleepy_engine(latency, "solo", 0.005).start()
    try:
        h = engine.submit(req("a", time.monotonic(), 60.0, answer=256, tau_min=1.0, tau_max=1.0))
        time.sleep(0.05)
        threading.Thread(target=h.abort).start()
        res = h.result(timeout=5)
    finally:
        engine.stop()
    assert res.state == RequestState.FINISHED_ABORTED
