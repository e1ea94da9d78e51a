"""A failed instance is rebuilt on its own devices (serving/cluster/recovery.py): with no instance
left the cluster holds requests until the rebuild serves, nothing is lost, a fault that keeps
coming back is rebuilt a bounded number of times, and a rebuild that fails releases what was held."""
import time

import pytest

from test_reshape import FakeBuilder, expected, make_cluster, tp_latency, _requests  # noqa: F401 - a fixture
from dilaserve_jax.serving.policy.request import RequestState
from dilaserve_jax.serving.policy.router import NoInstanceAvailable


class RebuildingBuilder(FakeBuilder):
    rebuilds_in_place = True

    def __init__(self, *a, fail_build=False, **kw):
        super().__init__(*a, **kw)
        self.fail_build, self.builds = fail_build, []

    def build(self, add, spec):
        self.builds.append([i.name for i in add])
        if self.fail_build:
            raise RuntimeError("devices lost their memory (injected)")
        time.sleep(0.2)  # a rebuild takes a while: requests arrive meanwhile
        return super().build(add, spec)


def rebuilding_cluster(tp_latency, spec, **kw):
    cluster = make_cluster(tp_latency, spec=spec)
    cluster.builder = RebuildingBuilder(tp_latency, **kw)
    return cluster


def inject_fault(engine, times=1):
    """The engine's runner raises on its next `times` steps (each new engine counts afresh)."""
    real = engine.runner.step
    left = [times]

    def faulty(*args, **kwargs):
        if left[0] > 0:
            left[0] -= 1
            raise RuntimeError("device fault (injected)")
        return real(*args, **kwargs)
    engine.runner.step = faulty


def _finish_all(requests, handles):
    for r, h in zip(requests, handles):
        res = h.result(timeout=60)
        assert res.state == RequestState.FINISHED_OK and res.tokens == expected(r), r.id


def test_the_only_instance_is_rebuilt_and_nothing_is_lost(tp_latency):
    cluster = rebuilding_cluster(tp_latency, "1x8")
    try:
        first = _requests(6, "a", answer=32)
        handles = [cluster.submit(r) for r in first]
        inject_fault(cluster.engines[0])
        time.sleep(0.05)
        assert cluster.refusal() is None  # arrivals are held for the rebuild, not refused
        later = _requests(6, "b", answer=16)
        handles += [cluster.submit(r) for r in later]
        _finish_all(first + later, handles)
        cluster.recovery.join(30)
        assert cluster.builder.builds == [["tp8@0-7"]]
        assert "injected" in cluster.failures["tp8@0-7"]
        assert cluster.engines[0].healthy and cluster.layout == "1x8"
        assert [r.reason for r in cluster.reconfigurations] == ["recovery of tp8@0-7"]
        assert cluster.recovery.done == [("tp8@0-7", "rebuilt")]
    finally:
        cluster.stop()


def test_one_of_two_failed_instances_is_rebuilt_while_the_other_serves(tp_latency):
    cluster = rebuilding_cluster(tp_latency, "2x4")
    try:
        requests = _requests(12, "a", answer=32)
        handles = [cluster.submit(r) for r in requests]
        inject_fault(cluster.engine("tp4@0-3"))
        _finish_all(requests, handles)
        cluster.recovery.join(30)
        assert cluster.builder.builds == [["tp4@0-3"]]
        assert [e.name for e in cluster.healthy_engines] == ["tp4@0-3", "tp4@4-7"]
    finally:
        cluster.stop()


def test_a_fault_that_keeps_coming_back_is_rebuilt_a_bounded_number_of_times(tp_latency):
    cluster = rebuilding_cluster(tp_latency, "2x4")
    cluster.recovery.max_rebuilds = 2
    try:
        for k in range(3):  # the instance fails three times; the third time it stays failed
            inject_fault(cluster.engine("tp4@0-3"))
            requests = _requests(8, f"r{k}-", answer=16)
            _finish_all(requests, [cluster.submit(r) for r in requests])
            cluster.recovery.join(30)
        assert cluster.builder.builds == [["tp4@0-3"], ["tp4@0-3"]]
        assert [e.name for e in cluster.healthy_engines] == ["tp4@4-7"]
    finally:
        cluster.stop()


def test_a_rebuild_that_fails_releases_the_held_requests_naming_the_fault(tp_latency):
    cluster = rebuilding_cluster(tp_latency, "1x8", fail_build=True)
    try:
        handles = [cluster.submit(r) for r in _requests(4, "a", answer=32)]
        inject_fault(cluster.engines[0])
        for h in handles:
            with pytest.raises(NoInstanceAvailable, match="injected"):
                h.result(timeout=30)
        cluster.recovery.join(30)
        assert cluster.recovery.done[-1][1].startswith("failed: RuntimeError")
        assert cluster.refusal() is not None and cluster.in_flight() == 0
    finally:
        cluster.stop()


def test_with_rebuilds_off_the_failed_instance_stays_failed(tp_latency):
    cluster = rebuilding_cluster(tp_latency, "1x8")
    cluster.recovery.enabled = False
    try:
        handles = [cluster.submit(r) for r in _requests(4, "a", answer=32)]
        inject_fault(cluster.engines[0])
        for h in handles:
            with pytest.raises(NoInstanceAvailable):
                h.result(timeout=30)
        assert cluster.builder.builds == []
    finally:
        cluster.stop()


def test_an_instance_failed_by_the_watchdog_is_not_rebuilt(tp_latency):
    from dilaserve_jax.serving.cluster.engine_types import HungStep

    cluster = rebuilding_cluster(tp_latency, "2x4")
    try:
        requests = _requests(8, "a", answer=32)
        handles = [cluster.submit(r) for r in requests]
        cluster.engine("tp4@0-3").fail(HungStep("a runner call has run 130 s (injected)"))
        _finish_all(requests, handles)
        cluster.recovery.join(30)
        assert cluster.builder.builds == [] and [e.name for e in cluster.healthy_engines] == ["tp4@4-7"]
    finally:
        cluster.stop()
