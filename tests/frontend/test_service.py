"""The gRPC front door over fake-runner instances: statuses, streaming, health, metrics, auth."""
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dilaserve_jax.frontend import dilaserve_pb2 as pb
from tests.frontend.conftest import ServerThread, fake_cluster, status_of


def test_unary_round_trip(fake_server):
    with fake_server.client() as c:
        r = c.generate("hello", max_new_tokens=32, block_length=16, request_id="abc")
    assert r.request_id == "abc" and len(r.token_ids) == 32 and r.text == "".join(map(chr, r.token_ids))
    assert r.finish_reason == pb.FINISH_REASON_LENGTH and r.steps > 0 and 0 < r.mean_tau <= 1
    assert r.total_ms >= r.decode_ms > 0 and r.deadline_met and r.instance.startswith("instance-")
    assert r.deadline_ms == pytest.approx(5000, rel=1e-3)  # server default SLO


def test_stream_fills_the_canvas_then_ends_with_the_final(fake_server):
    with fake_server.client() as c:
        events = list(c.generate_stream("hello", max_new_tokens=32, block_length=16))
    updates = [e.update for e in events[:-1]]
    final = events[-1].final
    assert all(e.HasField("update") for e in events[:-1]) and events[-1].HasField("final")
    assert len(updates) == final.steps
    masks = [u.canvas.count("_") for u in updates]
    assert masks == sorted(masks, reverse=True) and masks[-1] == 0 and masks[0] < 32
    assert updates[0].step_kind == "refresh" and updates[-1].canvas == final.text
    assert sum(u.tokens_committed for u in updates) == 32 == updates[-1].total_committed


def test_grpc_deadline_sets_the_schedule(fake_server):
    with fake_server.client() as c:
        r = c.generate("hello", timeout=3.0, slo_ms=100000)
    # The call's 3 s timeout, not the 100 s SLO. The server reads what remains of it from gRPC's
    # clock, which caches "now" and can lag a loaded machine by a few ms (3008.6 ms was seen).
    assert 2000 < r.deadline_ms <= 3050


def test_a_long_grpc_timeout_does_not_loosen_the_slo(fake_server):
    with fake_server.client() as c:
        r = c.generate("hello", timeout=600.0, slo_ms=1500)
    assert r.deadline_ms == pytest.approx(1500, rel=1e-3)  # the earlier of the two


BAD = [
    (dict(prompt=""), "text"),
    (dict(prompt=[]), "token_ids"),
    (dict(prompt="x" * 250, max_new_tokens=16), "max_new_tokens"),
    (dict(prompt="hi", max_new_tokens=0), "max_new_tokens"),
    (dict(prompt="hi", max_new_tokens=-3), "max_new_tokens"),
    (dict(prompt="hi", max_new_tokens=100000), "max_new_tokens"),
    (dict(prompt="hi", tau_min=0.0), "tau_min"),
    (dict(prompt="hi", tau_max=1.5), "tau_max"),
    (dict(prompt="hi", tau_min=0.9, tau_max=0.5), "tau_min"),
    (dict(prompt="hi", slo_ms=-5), "slo_ms"),
    (dict(prompt=[65, 9999]), "token_ids"),
    (dict(prompt=[65, 2]), "token_ids"),  # the mask id is not a prompt token
    (dict(prompt="héllo"), "text"),
    (dict(prompt="hi", block_length=0), "block_length"),
]


def test_bad_requests_are_invalid_argument_and_the_server_keeps_serving(fake_server):
    with fake_server.client() as c:
        for kw, field in BAD:
            prompt = kw.pop("prompt")
            code, details = status_of(lambda: c.generate(prompt, **kw))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (kw, details)
            assert details.startswith(field), (kw, details)
        assert len(c.generate("still fine", max_new_tokens=16).token_ids) == 16


def test_garbage_bytes_are_invalid_argument_and_unknown_fields_are_ignored(fake_server):
    channel = grpc.insecure_channel(fake_server.target)
    raw = channel.unary_unary("/dilaserve.v1.DiLaServe/Generate", request_serializer=lambda b: b,
                              response_deserializer=pb.GenerateResponse.FromString)
    code, details = status_of(lambda: raw(b"\xff\xff\xff\xff\x0f", timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "malformed" in details
    unknown_field_99 = bytes([0x98, 0x06, 0x01])  # field 99, varint 1
    r = raw(pb.GenerateRequest(text="hi", max_new_tokens=16).SerializeToString() + unknown_field_99, timeout=10)
    assert len(r.token_ids) == 16
    channel.close()


def test_queue_full_is_resource_exhausted():
    server = ServerThread(fake_cluster(instances=1, slots=1, max_queue=1, step_scale=20.0,
                                       policy="fcfs-static")).ready()
    try:
        codes, lock = [], threading.Lock()

        def one(i):
            with server.client() as c:
                try:
                    c.generate(f"req {i}", max_new_tokens=16, slo_ms=60000)
                    code = grpc.StatusCode.OK
                except grpc.RpcError as err:
                    code = err.code()
                    assert "queue full" in err.details()
            with lock:
                codes.append(code)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(5)]
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join(60)
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes and grpc.StatusCode.OK in codes
    finally:
        server.stop()


def _wait_idle(cluster, timeout=10.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if all(i["running"] == 0 and i["waiting"] == 0 for i in cluster.state()["instances"]):
            return True
        time.sleep(0.02)
    return False


def test_cancelled_stream_frees_its_slot():
    server = ServerThread(fake_cluster(instances=1, slots=1, step_scale=10.0)).ready()
    try:
        with server.client() as c:
            call = c.generate_stream("cancel me", max_new_tokens=64, block_length=16, slo_ms=60000)
            next(call)  # one step done: the request holds the only slot
            # the state is the snapshot the engine publishes after the iteration that streamed the update
            deadline = time.time() + 10.0
            while server.cluster.state()["instances"][0]["running"] != 1 and time.time() < deadline:
                time.sleep(0.02)
            assert server.cluster.state()["instances"][0]["running"] == 1
            call.cancel()
            assert _wait_idle(server.cluster)
            assert len(c.generate("next", max_new_tokens=16).token_ids) == 16
    finally:
        server.stop()


def test_passed_deadline_is_deadline_exceeded_and_aborts():
    server = ServerThread(fake_cluster(instances=1, slots=1, step_scale=10.0, policy="fcfs-static")).ready()
    try:
        with server.client() as c:
            code, _ = status_of(lambda: c.generate("slow", max_new_tokens=64, block_length=16, timeout=0.1))
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert _wait_idle(server.cluster)
    finally:
        server.stop()


def test_health_not_serving_until_ready_then_serving_then_not_serving_on_drain():
    server = ServerThread(fake_cluster())
    channel = grpc.insecure_channel(server.target)
    health = health_pb2_grpc.HealthStub(channel)
    check = lambda: health.Check(health_pb2.HealthCheckRequest(service="dilaserve.v1.DiLaServe"), timeout=5).status  # noqa: E731
    try:
        assert check() == health_pb2.HealthCheckResponse.NOT_SERVING
        with server.client(retries=False) as c:
            code, details = status_of(lambda: c.generate("too early"))
            assert code == grpc.StatusCode.UNAVAILABLE and "warming up" in details
        server.ready()
        assert check() == health_pb2.HealthCheckResponse.SERVING
        server.call(server.running.set_serving(False))
        server.running.service.draining = True
        assert check() == health_pb2.HealthCheckResponse.NOT_SERVING
        with server.client(retries=False) as c:
            code, details = status_of(lambda: c.generate("too late"))
            assert code == grpc.StatusCode.UNAVAILABLE and "draining" in details
    finally:
        channel.close()
        server.stop()


def test_cluster_state_says_serving_exactly_when_generate_is_accepted():
    """GetClusterState.serving and Generate read one predicate: false while the engines are created
    and while they run but warm up, true once a call is accepted, false again while draining."""
    server = ServerThread(fake_cluster())

    def observed(c):
        serving = c.cluster_state().serving
        try:
            c.generate("probe", max_new_tokens=16)
            return serving, "accepted"
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err
            return serving, err.details()

    try:
        with server.client(retries=False) as c:
            assert observed(c) == (False, "server is still compiling and warming up")
            server.cluster.start()  # engines running, warm-up not done
            assert observed(c) == (False, "server is still compiling and warming up")
            server.cluster.warm_up()
            assert observed(c) == (True, "accepted")
            server.running.service.draining = True
            assert observed(c) == (False, "server is draining; retry on another replica")
    finally:
        server.stop()


def test_drain_lets_in_flight_requests_finish():
    server = ServerThread(fake_cluster(instances=1, slots=2, step_scale=5.0)).ready()
    results = []
    with server.client() as c:
        t = threading.Thread(target=lambda: results.append(c.generate("in flight", max_new_tokens=32, slo_ms=60000)))
        t.start()
        time.sleep(0.1)
        assert server.call(server.running.drain_and_stop(20.0)) is True
        t.join(10)
    server.cluster.stop()
    server.loop.call_soon_threadsafe(server.loop.stop)
    assert len(results) == 1 and len(results[0].token_ids) == 32


def test_metrics_endpoint_counts_requests(fake_server):
    with fake_server.client() as c:
        for _ in range(3):
            c.generate("count me", max_new_tokens=16)
        status_of(lambda: c.generate("", max_new_tokens=16))
    body = urllib.request.urlopen(f"http://127.0.0.1:{fake_server.running.metrics_port}/metrics", timeout=10).read().decode()
    assert 'dilaserve_requests_total{outcome="ok"} 3.0' in body
    assert 'dilaserve_requests_total{outcome="invalid"} 1.0' in body
    assert 'dilaserve_deadlines_total{result="met"} 3.0' in body
    assert 'dilaserve_step_seconds_count{kind="refresh"}' in body and "dilaserve_tau_bucket" in body
    assert 'dilaserve_queue_length{instance="instance-0"} 0.0' in body
    assert 'dilaserve_layout_info{layout="2x1"' in body


def test_cluster_state(fake_server):
    with fake_server.client() as c:
        state = c.cluster_state()
    assert state.layout == "2x1" and state.policy == "dilaserve" and state.serving
    assert [i.name for i in state.instances] == ["instance-0", "instance-1"] and state.instances[0].slots == 4


def test_auth_rejects_missing_or_wrong_token():
    server = ServerThread(fake_cluster(), auth_token="s3cret").ready()
    try:
        for token in (None, "wrong"):
            with server.client(auth_token=token) as c:
                code, details = status_of(lambda: c.generate("hi", max_new_tokens=16))
                assert code == grpc.StatusCode.UNAUTHENTICATED
                code, _ = status_of(lambda: list(c.generate_stream("hi", max_new_tokens=16)))
                assert code == grpc.StatusCode.UNAUTHENTICATED
        with server.client(auth_token="s3cret") as c:
            assert len(c.generate("hi", max_new_tokens=16).token_ids) == 16
        channel = grpc.insecure_channel(server.target)  # health stays open for probes
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        channel.close()
    finally:
        server.stop()


def test_reflection_lists_the_service(fake_server):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    channel = grpc.insecure_channel(fake_server.target)
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"dilaserve.v1.DiLaServe", "grpc.health.v1.Health"} <= names
    channel.close()
