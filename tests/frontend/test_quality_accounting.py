"""The accuracy-loss budget over gRPC: per-request bound, GetClusterState and metrics accounting."""
import urllib.request

import grpc
import pytest

from tests.frontend.conftest import ServerThread, fake_cluster, status_of
from dilaserve_jax.serving.policy.threshold import ThresholdConfig

TAUS = (1.0, 0.9, 0.7, 0.5)


def rows():
    acc = {"a": (0.95, 0.95, 0.9, 0.5), "b": (0.9, 0.9, 0.9, 0.9)}
    return [{"task": t, "kind": "deterministic", "threshold": tau, "accuracy": a, "tokens_per_step": 1 + 4 * (1 - tau),
             "steps": 8.0, "n": 20, "answer_length": 32} for t in acc for tau, a in zip(TAUS, acc[t])]


@pytest.fixture
def budget_server():
    server = ServerThread(fake_cluster(threshold=ThresholdConfig.from_eval(rows(), max_accuracy_drop=1.5))).ready()
    yield server
    server.stop()


def test_cluster_state_and_metrics_show_budget_spent_and_mean_tau(budget_server):
    with budget_server.client() as c:
        replies = [c.generate("tight", max_new_tokens=32, slo_ms=80) for _ in range(2)]
        replies += [c.generate("loose", max_new_tokens=32, slo_ms=5000, max_accuracy_drop=0.0) for _ in range(2)]
        state = c.cluster_state()
    served = sum(i.quality.served for i in state.instances)
    assert served == 4
    for inst in state.instances:
        q = inst.quality
        assert q.HasField("budget") and q.budget == 1.5 and q.mode == "adaptive"
        if q.served:
            assert 0.0 <= q.predicted_loss_mean <= 1.5 and 0.0 < q.mean_tau <= 1.0
            assert q.predicted_loss_spent == pytest.approx(q.predicted_loss_mean * q.served)
    spent = sum(i.quality.predicted_loss_spent for i in state.instances)
    assert spent == pytest.approx(sum(r.predicted_accuracy_loss for r in replies))
    assert all(r.predicted_accuracy_loss == 0.0 for r in replies[2:])  # held to their own bound of 0
    body = urllib.request.urlopen(f"http://127.0.0.1:{budget_server.running.metrics_port}/metrics",
                                  timeout=10).read().decode()
    assert 'dilaserve_accuracy_budget_points{instance="instance-0"} 1.5' in body
    assert "dilaserve_predicted_loss_points_mean" in body and 'dilaserve_mean_tau{instance="' in body


def test_bad_bound_is_invalid_argument(budget_server):
    with budget_server.client() as c:
        code, details = status_of(lambda: c.generate("x", max_new_tokens=16, max_accuracy_drop=-1.0))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("max_accuracy_drop")


def test_without_an_accuracy_model_the_state_has_no_quality(fake_server):
    with fake_server.client() as c:
        state = c.cluster_state()
    assert not any(i.HasField("quality") for i in state.instances)
