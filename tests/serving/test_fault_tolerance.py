"""Faults at the thread boundaries: a runner that raises, an engine loop that dies, a hung step.
Nothing is lost: the failed instance's requests finish on the survivors with the same tokens."""
import random
import threading
import time

import pytest

from serving_support import req
from dilaserve_jax.serving.cluster.cluster import Cluster, DuplicateRequest, InstanceInfo
from dilaserve_jax.serving.cluster.weights_swap import NewWeights
from dilaserve_jax.serving.cluster.engine import Engine
from dilaserve_jax.serving.cluster.engine_types import EngineUnavailable
from dilaserve_jax.serving.policy.snapshots import EngineState
from dilaserve_jax.serving.cluster.fake_runner import FakeRunner
from dilaserve_jax.serving.policy.request import RequestState
from dilaserve_jax.serving.policy.router import NoInstanceAvailable
from dilaserve_jax.serving.policy.scheduler import Scheduler, SchedulerConfig

STEP_S = 0.002


class FaultyRunner(FakeRunner):
    """Raises on its `fail_at`-th step (1-based), or sleeps `hang_s` there."""

    def __init__(self, *a, fail_at=None, hang_s=0.0, **kw):
        super().__init__(*a, **kw)
        self.fail_at, self.hang_s, self.calls = fail_at, hang_s, 0

    def step(self, kind, slots, taus, blocks=None):
        self.calls += 1
        if self.calls == self.fail_at:
            if self.hang_s:
                time.sleep(self.hang_s)
            else:
                raise RuntimeError("device lost (injected)")
        return super().step(kind, slots, taus, blocks)


class DyingScheduler(Scheduler):
    """A scheduler bug: `update` raises on its `fail_at`-th call, killing the loop thread."""

    def __init__(self, *a, fail_at, **kw):
        super().__init__(*a, **kw)
        self.fail_at, self.calls = fail_at, 0

    def update(self, plan, outcomes, now):
        self.calls += 1
        if self.calls == self.fail_at:
            raise KeyError("scheduler bug (injected)")
        return super().update(plan, outcomes, now)


def make_cluster(latency, runners, scheduler_cls=Scheduler, step_timeout_s=None, slots=4, **sched_kw):
    engines = []
    for i, runner in enumerate(runners):
        cfg = SchedulerConfig(slots, policy="fcfs-static")
        sched = scheduler_cls(cfg, latency, **sched_kw) if i == 0 else Scheduler(cfg, latency)  # fault on instance-0
        engines.append(Engine(runner, sched, clock=time.monotonic, name=f"instance-{i}"))
    infos = [InstanceInfo(e.name, 1, (i,)) for i, e in enumerate(engines)]
    cluster = Cluster(engines, infos, layout=f"{len(engines)}x1", policy="fcfs-static", model_source="fake",
                      tokenizer=None, limits=None, step_timeout_s=step_timeout_s,
                      loader=lambda source, step: NewWeights(source, {e.name: int(source) for e in engines}))
    cluster.start()
    cluster.ready = True
    return cluster


def sleepy(fail_at=None, hang_s=0.0, slots=4):
    return FaultyRunner(slots, step_time=lambda k, b, l, blk: STEP_S, real_sleep=True, fail_at=fail_at, hang_s=hang_s)


def expected_tokens(r, weights=0):
    """What FakeRunner commits for request r, whatever instance (and how many) ran it."""
    return tuple(10 + (sum(r.prompt_tokens) * 31 + p * 7 + weights * 13) % 1000 for p in range(r.answer_length))


def _requests(n, prefix="r"):
    now = time.monotonic()
    return [req(f"{prefix}{i}", now, 60.0, answer=32, block=16, prompt=8 + i % 5, first_token=3 + i) for i in range(n)]


def _check_all_finished(cluster, requests, handles):
    results = [h.result(timeout=30) for h in handles]
    for r, res in zip(requests, results):
        assert res.state == RequestState.FINISHED_OK, (r.id, res)
        assert res.tokens == expected_tokens(r), r.id
    assert cluster.in_flight() == 0
    return results


@pytest.mark.parametrize("fault", ["runner raises", "loop dies"])
def test_failed_instance_requests_finish_on_the_survivor(latency, fault):
    if fault == "runner raises":
        cluster = make_cluster(latency, [sleepy(fail_at=6), sleepy()])
    else:
        cluster = make_cluster(latency, [sleepy(), sleepy()], scheduler_cls=DyingScheduler, fail_at=6)
    events = []
    cluster.add_listener(lambda event, details: events.append((event, details)))
    try:
        requests = _requests(16)
        handles = [cluster.submit(r) for r in requests]
        results = _check_all_finished(cluster, requests, handles)
        state = cluster.state()
        inst = {i["name"]: i for i in state["instances"]}
        assert inst["instance-0"]["state"] == "failed" and "injected" in inst["instance-0"]["error"]
        assert inst["instance-1"]["state"] == "running"
        assert "injected" in state["failures"]["instance-0"]
        moved = [r for r in results if r.moves]
        assert moved and all(r.instance == "instance-1" for r in moved)
        assert state["migrations"]["failure"] == len(moved)
        assert [e for e, _ in events].count("failure") == 1
        # the router skips the failed instance from now on
        late = _requests(4, prefix="late")
        for h in [cluster.submit(r) for r in late]:
            assert h.result(timeout=30).instance == "instance-1"
    finally:
        cluster.stop()


def test_a_hung_step_is_failed_by_the_watchdog(latency):
    cluster = make_cluster(latency, [sleepy(fail_at=3, hang_s=3.0), sleepy()], step_timeout_s=0.3)
    try:
        requests = _requests(8)
        t0 = time.monotonic()
        handles = [cluster.submit(r) for r in requests]
        _check_all_finished(cluster, requests, handles)
        assert time.monotonic() - t0 < 2.5  # did not wait for the hung step
        snap = cluster.engine("instance-0").snapshot()
        assert snap.state == EngineState.FAILED and "watchdog" in snap.error
    finally:
        time.sleep(3.0)  # let the hung step return: the dead loop must then leave everything alone
        cluster.stop()
    assert all(h.result(0).state == RequestState.FINISHED_OK for h in handles)


def test_when_no_instance_survives_calls_fail_naming_the_fault(latency):
    cluster = make_cluster(latency, [sleepy(fail_at=2), sleepy(fail_at=2)])
    try:
        handles = [cluster.submit(r) for r in _requests(6)]
        for h in handles:
            with pytest.raises(NoInstanceAvailable, match="device lost"):
                h.result(timeout=30)
        with pytest.raises(NoInstanceAvailable, match="instance-0: failed"):
            cluster.submit(_requests(1, prefix="after")[0])
        assert cluster.in_flight() == 0 and not cluster.healthy_engines
    finally:
        cluster.stop()


def test_request_ids_are_unique_across_the_cluster(latency):
    cluster = make_cluster(latency, [sleepy(), sleepy()])
    try:
        now = time.monotonic()
        first = cluster.submit(req("same", now, 60.0, answer=64, tau_min=1.0, tau_max=1.0))
        with pytest.raises(DuplicateRequest):
            cluster.submit(req("same", now, 60.0))
        assert first.result(timeout=30).state == RequestState.FINISHED_OK
        assert cluster.submit(req("same", time.monotonic(), 60.0)).result(timeout=30).state == RequestState.FINISHED_OK
    finally:
        cluster.stop()


def test_abort_during_failover_still_aborts(latency):
    cluster = make_cluster(latency, [sleepy(fail_at=4, hang_s=0.5), sleepy()], step_timeout_s=0.2)
    try:
        r = req("victim", time.monotonic(), 60.0, answer=256, tau_min=1.0, tau_max=1.0)
        h = cluster.submit(r)
        while cluster.engine("instance-0").runner.calls < 4 and cluster.instance_of("victim") == "instance-0":
            time.sleep(0.01)
        cluster.abort("victim")  # lands around the take-over, wherever the request is
        assert h.result(timeout=30).state == RequestState.FINISHED_ABORTED
    finally:
        time.sleep(0.5)
        cluster.stop()


def test_stop_that_times_out_keeps_the_engine_unusable(latency):
    runner = sleepy(fail_at=1, hang_s=1.0)
    engine = Engine(runner, Scheduler(SchedulerConfig(4), latency), clock=time.monotonic, name="slow").start()
    engine.submit(req("a", time.monotonic(), 60.0))
    time.sleep(0.1)
    with pytest.raises(TimeoutError):
        engine.stop(timeout=0.05)
    with pytest.raises(RuntimeError, match="already running"):
        engine.start()
    engine.stop(timeout=5)  # the step returns, the loop ends
    with pytest.raises(EngineUnavailable):
        engine.submit(req("b", time.monotonic(), 60.0))


def test_hooks_and_calls_run_on_the_engine_thread(latency):
    engine = Engine(sleepy(), Scheduler(SchedulerConfig(4), latency), clock=time.monotonic, name="e").start()
    try:
        seen = []
        engine.add_step_hook(lambda *a: seen.append(threading.current_thread().name))
        assert engine.call(lambda: threading.current_thread().name).result(5) == "engine-e"
        engine.submit(req("a", time.monotonic(), 60.0, answer=16)).result(10)
        assert seen and set(seen) == {"engine-e"}
        with pytest.raises(ZeroDivisionError):
            engine.call(lambda: 1 / 0).result(5)
        assert engine.healthy  # a failing call is the caller's problem, not the instance's
    finally:
        engine.stop()


def test_stress_submit_abort_snapshot_reload_from_many_threads(latency):
    cluster = make_cluster(latency, [sleepy(), sleepy()])
    lock = threading.Lock()
    submitted, duplicates, handles = [], [], {}
    stop = threading.Event()

    def client(k):
        rng = random.Random(k)
        i = 0
        while not stop.is_set():
            rid = f"c{k}-{i}" if rng.random() > 0.1 else f"dup-{rng.randrange(3)}"
            r = req(rid, time.monotonic(), 60.0, answer=16 * rng.randint(1, 3), block=16, prompt=rng.randint(4, 12),
                    first_token=3 + k)
            try:
                h = cluster.submit(r)
            except DuplicateRequest:
                with lock:
                    duplicates.append(rid)
                continue
            with lock:
                submitted.append(r)
                handles.setdefault(rid, []).append(h)
            if rng.random() < 0.2:
                h.abort()
            i += 1
            time.sleep(rng.random() * 0.003)

    def admin():
        weights = 0
        while not stop.is_set():
            for e in cluster.engines:
                e.snapshot()
            cluster.state()
            if random.random() < 0.1:
                weights = 1 - weights
                cluster.reload(str(weights))
            time.sleep(0.005)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(6)] + [threading.Thread(target=admin)]
    for t in threads:
        t.start()
    time.sleep(3.0)
    stop.set()
    for t in threads:
        t.join(10)
    try:
        outcomes = {}
        for rid, hs in handles.items():
            for h in hs:
                res = h.result(timeout=30)
                assert res.state in (RequestState.FINISHED_OK, RequestState.FINISHED_ABORTED,
                                     RequestState.FINISHED_REJECTED), res  # rejected: queue full, by design
                outcomes.setdefault(res.state, 0)
                outcomes[res.state] += 1
        assert sum(outcomes.values()) == len(submitted) > 50  # each finished exactly once
        assert outcomes.get(RequestState.FINISHED_ABORTED, 0) > 0 and duplicates
        assert cluster.in_flight() == 0
        time.sleep(0.1)  # the loops release slots with their next plan
        for e in cluster.engines:
            e.call(lambda: None).result(5)  # one more iteration applies the last releases
            snap = e.snapshot()
            assert snap.state == EngineState.RUNNING and not snap.load.running_left and not snap.load.waiting_left
            assert e.call(lambda e=e: (len(e.scheduler.free_slots), len(e.runner.slots))).result(5) == (4, 0)
    finally:
        cluster.stop()
