"""Admission over gRPC: a call that cannot meet its deadline is served late by default and refused
(RESOURCE_EXHAUSTED) when it or the server asks for strict admission."""
import grpc
import pytest

from tests.frontend.conftest import ServerThread, fake_cluster


@pytest.fixture(scope="module")
def slow_server():
    server = ServerThread(fake_cluster(instances=1, slots=2, step_scale=20.0)).ready()  # ~80 ms refresh steps
    yield server
    server.stop()


def test_a_hopeless_call_is_served_late_by_default(slow_server):
    with slow_server.client() as c:
        r = c.generate("late", max_new_tokens=16, block_length=16, slo_ms=1)
    assert len(r.token_ids) == 16 and not r.deadline_met


def test_a_call_may_ask_for_strict_admission(slow_server):
    with slow_server.client() as c, pytest.raises(grpc.RpcError) as err:
        c.generate("late", max_new_tokens=16, block_length=16, slo_ms=1, strict_admission=True)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "strict admission" in err.value.details()
    with slow_server.client() as c:  # and the server keeps serving
        assert c.generate("fine", max_new_tokens=16, block_length=16, slo_ms=60_000).deadline_met
