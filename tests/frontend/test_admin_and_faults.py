"""Admin calls are privileged, reloads stay inside the weights roots, errors are bounded; clients
retry UNAVAILABLE; ids are cluster-wide; a cluster with no instance left answers UNAVAILABLE."""
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dilaserve_jax.frontend import dilaserve_pb2 as pb
from dilaserve_jax.frontend.admin import bounded, reload_refusal, weights_roots
from dilaserve_jax.frontend.service import END_MARK, finish_reason, render_canvas
from dilaserve_jax.models import CharTokenizer
from tests.frontend.conftest import CharFakeRunner, ServerThread, fake_cluster, status_of


def test_finish_reason_comes_from_the_untruncated_answer():
    # answer area 32, caller asked for 5: an EOS at position 10 means the answer was cut
    assert finish_reason(10, 5, 32) == pb.FINISH_REASON_LENGTH
    assert finish_reason(3, 5, 32) == pb.FINISH_REASON_STOP
    assert finish_reason(5, 5, 32) == pb.FINISH_REASON_STOP  # ended exactly at the limit
    assert finish_reason(32, 32, 32) == pb.FINISH_REASON_LENGTH  # filled without an EOS


def test_canvas_keeps_one_character_per_position():
    tok = CharTokenizer()
    ids = [ord("a"), tok.mask_id, ord("b"), tok.eos_id, tok.mask_id, tok.eos_id]
    assert render_canvas(tok, ids) == "a_b" + END_MARK * 3


def test_weights_roots_and_refusals(tmp_path):
    inside, outside = tmp_path / "root" / "ckpt", tmp_path / "elsewhere"
    inside.mkdir(parents=True)
    outside.mkdir()
    (tmp_path / "root" / "escape").symlink_to(outside)
    roots = weights_roots("orbax:/nowhere/run@3", [tmp_path / "root"])
    assert roots[0].name == "run" and roots[1] == (tmp_path / "root").resolve()
    assert reload_refusal(str(inside), roots) is None
    assert reload_refusal("tiny", roots) is None  # package data
    assert "outside the weights roots" in reload_refusal(str(outside), roots)
    assert reload_refusal(str(tmp_path / "root" / "escape"), roots) is not None  # a link cannot lead out
    assert reload_refusal(str(tmp_path / "root" / ".." / "elsewhere"), roots) is not None
    assert len(bounded("x" * 100_000)) <= 1024


@pytest.fixture
def secured(tmp_path):
    server = ServerThread(fake_cluster(), auth_token="inference-token", admin_token="admin-token",
                          weights_roots=(str(tmp_path),)).ready()
    yield server, tmp_path
    server.stop()


def test_admin_calls_need_the_admin_token(secured):
    server, root = secured
    target = str(root / "ckpt")
    with server.client(retries=False) as c:
        code, _ = status_of(lambda: c.reload_weights(target))
        assert code == grpc.StatusCode.UNAUTHENTICATED
    with server.client(auth_token="inference-token", retries=False) as c:
        code, details = status_of(lambda: c.reload_weights(target))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "admin" in details
        code, _ = status_of(lambda: c.reconfigure("1x2"))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert len(c.generate("hi", max_new_tokens=16).token_ids) == 16
    with server.client(auth_token="inference-token", admin_token="admin-token", retries=False) as c:
        assert c.reload_weights(target).model == f"fake:{target}"
        assert c.cluster_state().reloads == 1
        code, details = status_of(lambda: c.reload_weights("/etc"))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "weights roots" in details
        code, details = status_of(lambda: c.reload_weights("z" * 5000))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and len(details) <= 1024
    with server.client(auth_token="admin-token") as c:  # the admin token also serves inference
        assert len(c.generate("hi", max_new_tokens=16).token_ids) == 16


def test_admin_calls_are_refused_on_a_reachable_address_without_an_admin_token(tmp_path):
    server = ServerThread(fake_cluster(), host="0.0.0.0", weights_roots=(str(tmp_path),)).ready()
    try:
        with server.client(retries=False) as c:
            code, details = status_of(lambda: c.reload_weights(str(tmp_path)))
            assert code == grpc.StatusCode.PERMISSION_DENIED and "--admin-token" in details
            assert len(c.generate("hi", max_new_tokens=16).token_ids) == 16
    finally:
        server.stop()


def test_a_second_reload_while_one_runs_is_failed_precondition(tmp_path):
    server = ServerThread(fake_cluster(load_delay_s=1.0), weights_roots=(str(tmp_path),)).ready()
    try:
        codes = []

        def reload():
            with server.client(retries=False) as c:
                try:
                    c.reload_weights(str(tmp_path))
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as err:
                    codes.append(err.code())

        threads = [threading.Thread(target=reload) for _ in range(2)]
        for t in threads:
            t.start()
            time.sleep(0.2)
        for t in threads:
            t.join(30)
        assert sorted(c.name for c in codes) == ["FAILED_PRECONDITION", "OK"]
    finally:
        server.stop()


def test_client_retries_unavailable_until_the_server_is_ready():
    server = ServerThread(fake_cluster())
    try:
        threading.Timer(0.4, server.ready).start()
        with server.client() as c:
            assert len(c.generate("patience", max_new_tokens=16, timeout=20).token_ids) == 16
    finally:
        time.sleep(0.5)
        server.stop()


def test_request_ids_are_cluster_wide_and_returned():
    server = ServerThread(fake_cluster(step_scale=10.0)).ready()
    try:
        with server.client() as c:
            call = c.stub.Generate.future(c.request("long one", max_new_tokens=64, request_id="same"))
            time.sleep(0.1)
            code, details = status_of(lambda: c.generate("other", max_new_tokens=16, request_id="same"))
            assert code == grpc.StatusCode.ALREADY_EXISTS and "same" in details
            assert call.result(timeout=30).request_id == "same"
            reply, call = c.stub.Generate.with_call(c.request("no id", max_new_tokens=16))
            assert reply.request_id and dict(call.initial_metadata())["x-request-id"] == reply.request_id
    finally:
        server.stop()


class FailingRunner(CharFakeRunner):
    def step(self, kind, slots, taus, blocks=None):
        raise RuntimeError("device on fire (injected)")


def test_no_surviving_instance_is_unavailable_naming_the_fault():
    server = ServerThread(fake_cluster(runner_cls=FailingRunner)).ready()
    channel = grpc.insecure_channel(server.target)
    try:
        with server.client(retries=False) as c:
            code, details = status_of(lambda: c.generate("doomed", max_new_tokens=16))
            assert code == grpc.StatusCode.UNAVAILABLE and "device on fire" in details
            state = c.cluster_state()
            assert not state.serving and {i.state for i in state.instances} == {"failed"}
        check = health_pb2_grpc.HealthStub(channel).Check
        deadline = time.time() + 5
        while check(health_pb2.HealthCheckRequest(), timeout=5).status != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.time() < deadline, "health still SERVING with every instance failed"
            time.sleep(0.05)
    finally:
        channel.close()
        server.stop()


def test_client_cli_prints_zero_counts_and_the_finish_reason(fake_server, capsys):
    from dilaserve_jax import client

    assert client.main(["--target", fake_server.target, "--state"]) == 0
    out = capsys.readouterr().out
    assert '"running": 0' in out and '"waiting": 0' in out
    assert client.main(["--target", fake_server.target, "--max-new-tokens", "16", "hello"]) == 0
    err = capsys.readouterr().err
    assert "length (cut by max_new_tokens" in err
