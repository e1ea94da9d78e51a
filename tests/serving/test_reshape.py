"""Reconfiguration and migration on fake instances: requests in flight move at step boundaries and
finish with their tokens, new requests are never refused, and the autoscaler moves an at-risk
request to an idle instance."""
import threading
import time

import pytest

from serving_support import req
from dilaserve_jax.serving.cluster.autoscale import Autoscaler
from dilaserve_jax.core.layouts import parse_layout, placements
from dilaserve_jax.serving.cluster.cluster import Cluster, ClusterBusy, InstanceInfo
from dilaserve_jax.serving.policy.controller import ClusterController, ControllerConfig
from dilaserve_jax.serving.cluster.engine import Engine
from dilaserve_jax.serving.cluster.fake_runner import FakeRunner, fake_tp_profile, tp_step_time
from dilaserve_jax.serving.policy.latency import LatencyModel
from dilaserve_jax.serving.policy.request import RequestState
from dilaserve_jax.serving.policy.scheduler import Scheduler, SchedulerConfig

DEVICES = 8


def _name(tp, first):
    return f"tp{tp}@{first}" if tp == 1 else f"tp{tp}@{first}-{first + tp - 1}"


class FakeBuilder:
    """The InstanceBuilder protocol over fake runners (instances named as the real ones)."""

    def __init__(self, latency, slots=4, scale=1.0, overlap=True, policy="fcfs-static"):
        self.latency, self.slots, self.scale, self.overlap, self.policy = latency, slots, scale, overlap, policy
        self.released = []

    def plan(self, spec):
        tps = parse_layout(spec)
        if sum(tps) != DEVICES:
            raise ValueError(f"{spec} does not cover {DEVICES} devices")
        return [InstanceInfo(_name(tp, first), tp, tuple(range(first, first + tp))) for tp, first in placements(tps)]

    def engine(self, info):
        step = tp_step_time(info.tp_degree)
        runner = FakeRunner(self.slots, real_sleep=True, tp_degree=info.tp_degree,
                            step_time=lambda k, b, l, blk: self.scale * step(k, b, l, blk))
        sched = Scheduler(SchedulerConfig(self.slots, policy=self.policy, tp=info.tp_degree), self.latency)
        return Engine(runner, sched, clock=time.monotonic, name=info.name)

    def overlap_fits(self, add):
        return self.overlap

    def build(self, add, spec):
        return [self.engine(i) for i in add], 1000 * len(add), 0.0

    def prepare(self, engine):
        engine.call(lambda: None).result(5)

    def release(self, names):
        self.released += list(names)

    def compiled_placements(self):
        return frozenset()


@pytest.fixture(scope="module")
def tp_latency():
    return LatencyModel.from_profile(fake_tp_profile((1, 2, 4, 8)))


def make_cluster(tp_latency, spec="2x4", **kw):
    builder = FakeBuilder(tp_latency, **kw)
    infos = builder.plan(spec)
    engines = [builder.engine(i) for i in infos]
    cluster = Cluster(engines, infos, layout=spec, policy="fcfs-static", model_source="fake", tokenizer=None,
                      limits=None, step_timeout_s=None)
    cluster.builder = builder
    cluster.start()
    cluster.ready = True
    return cluster


def expected(r):
    return tuple(10 + (sum(r.prompt_tokens) * 31 + p * 7) % 1000 for p in range(r.answer_length))


def _requests(n, prefix, answer=64):
    now = time.monotonic()
    return [req(f"{prefix}{i}", now, 120.0, answer=answer, block=16, prompt=6 + i % 7, first_token=3 + i,
                tau_min=1.0, tau_max=1.0) for i in range(n)]


@pytest.mark.parametrize("overlap", [True, False])
def test_reconfigure_moves_requests_in_flight_and_refuses_none(tp_latency, overlap):
    cluster = make_cluster(tp_latency, scale=3.0, overlap=overlap)
    try:
        first = _requests(12, "a")
        handles = [cluster.submit(r) for r in first]
        time.sleep(0.1)  # they are running
        late, late_handles, stop = [], [], threading.Event()

        def keep_sending():
            i = 0
            while not stop.is_set():
                r = _requests(1, f"late{i}-", answer=16)[0]
                late.append(r)
                late_handles.append(cluster.submit(r))  # raises if refused
                i += 1
                time.sleep(0.005)

        sender = threading.Thread(target=keep_sending)
        sender.start()
        report = cluster.reconfigure("8x1")
        stop.set()
        sender.join()
        assert report.mode == ("overlap" if overlap else "pause") and report.new == "8x1"
        assert set(report.removed) == {"tp4@0-3", "tp4@4-7"} and len(report.added) == 8
        assert report.requests_moved > 0 and cluster.builder.released == list(report.removed)
        for r, h in zip(first + late, handles + late_handles):
            res = h.result(timeout=60)
            assert res.state == RequestState.FINISHED_OK and res.tokens == expected(r), r.id
        moved = [h.result(0) for h in handles if h.result(0).moves]
        assert moved and all(m.instance.startswith("tp1@") for m in moved)
        assert cluster.layout == "8x1" and [e.name for e in cluster.engines] == [f"tp1@{i}" for i in range(8)]
        assert cluster.migrations["reconfigure"] == report.requests_moved and late
    finally:
        cluster.stop()


def test_reconfigure_keeps_shared_instances_and_rejects_bad_or_concurrent_calls(tp_latency):
    cluster = make_cluster(tp_latency)
    try:
        kept = cluster.engine("tp4@0-3")
        report = cluster.reconfigure("4+2+1+1")
        assert report.kept == ("tp4@0-3",) and cluster.engine("tp4@0-3") is kept
        assert cluster.reconfigure("4+2+1+1").mode == "none"
        with pytest.raises(ValueError):
            cluster.reconfigure("3x3")
        cluster._admin.acquire()
        try:
            with pytest.raises(ClusterBusy):
                cluster.reconfigure("1x8")
        finally:
            cluster._admin.release()
    finally:
        cluster.stop()


def test_migrate_moves_one_request_to_the_target(tp_latency):
    cluster = make_cluster(tp_latency, scale=3.0)
    try:
        r = _requests(1, "m", answer=128)[0]
        h = cluster.submit(r, instance="tp4@0-3")
        time.sleep(0.05)
        assert cluster.migrate(r.id, "tp4@4-7", "rebalance")
        res = h.result(timeout=60)
        assert res.state == RequestState.FINISHED_OK and res.tokens == expected(r)
        assert res.instance == "tp4@4-7" and res.moves == 1 and cluster.migrations["rebalance"] == 1
    finally:
        cluster.stop()


def test_the_autoscaler_moves_an_at_risk_request_to_the_idle_instance(tp_latency):
    cluster = make_cluster(tp_latency, slots=2, scale=4.0, policy="dilaserve")
    ctl = ClusterController(ControllerConfig(interval_s=0.05), num_devices=DEVICES, tp_degrees=(1, 2, 4, 8),
                            latency=tp_latency, slots=2, param_bytes=1000, layouts=["2x4"])
    scaler = Autoscaler(cluster, ctl, mode="manual")
    try:
        now = time.monotonic()
        # six requests pinned to one instance: two run, the queued ones cannot make it there
        busy = [req(f"b{i}", now, 0.15 + 0.01 * i, answer=64, block=16, prompt=6, first_token=3 + i, tau_min=0.9)
                for i in range(6)]
        handles = [cluster.submit(r, instance="tp4@0-3") for r in busy]
        deadline = time.time() + 5
        while not any(s.load.at_risk for s in (e.snapshot() for e in cluster.engines)):
            assert time.time() < deadline, "no request became at risk"
            time.sleep(0.005)
        scaler.round(time.monotonic())
        assert scaler.migrations and all(m.target == "tp4@4-7" for _, m in scaler.migrations)
        results = [h.result(timeout=30) for h in handles]
        moved = [r for r in results if r.moves]
        assert moved and all(r.instance == "tp4@4-7" for r in moved)
        assert all(r.state == RequestState.FINISHED_OK for r in results)
        # the next round checks its prediction against what the layout realised: these six
        d = scaler.round(time.monotonic())
        assert d.realised == pytest.approx(sum(r.deadline_met for r in results) / len(results))
        assert f"realised {d.realised:.1%}" in str(d)
    finally:
        cluster.stop()
