"""The leader's side of multi-host serving without Ray: two in-process HostWorkers behind
LocalTransports (which pickle what crosses, as Ray does), the ordinary Cluster over their
RemoteEngines. Losing a host, moving a request, the stream of a request that moved, the hosts'
step metrics at the leader, and weights swapped in on every host."""
import time

from dilaserve_jax.core.kinds import StepKind
from dilaserve_jax.serving.cluster.builder import InstanceInfo
from dilaserve_jax.serving.cluster.cluster import Cluster
from dilaserve_jax.serving.cluster.hosts.fake_hosts import FakeHostFactory, letter_answer
from dilaserve_jax.serving.cluster.hosts.link import HostLink, LocalTransport
from dilaserve_jax.serving.cluster.hosts.remote_engine import RemoteEngine
from dilaserve_jax.serving.cluster.hosts.step_tally import HostStepTotals
from dilaserve_jax.serving.cluster.hosts.worker import HostWorker
from dilaserve_jax.serving.cluster.weights_swap import NewWeights
from dilaserve_jax.serving.policy.request import Request, RequestState


def _host(name, step_s=0.002, step_totals=None):
    worker = HostWorker(name, FakeHostFactory(instances=2, step_s=step_s))
    transport = LocalTransport(worker)
    link = HostLink(name, transport, step_totals=step_totals)
    _, snaps = worker.poll(0.0)
    engines = [RemoteEngine(link, i.name, f"{name}/{i.name}", snaps[i.name]) for i in worker.info().infos]
    link.attach(engines)
    return worker, transport, link, engines


def _cluster(hosts):
    engines = [e for h in hosts for e in h[3]]
    infos = [InstanceInfo(e.name, 1, (0,), e.name.split("/")[0]) for e in engines]
    cluster = Cluster(engines, infos, layout="2x1|2x1", policy="fcfs-static", model_source="fake", tokenizer=None,
                      limits=None, step_timeout_s=None)
    for h in hosts:
        h[2].start()
    cluster.start()
    cluster.warm_up()
    return cluster


def _stop(cluster, hosts):
    cluster.stop()
    for worker, _, link, _ in hosts:
        link.stop()
        worker.stop()


def _requests(n, answer=64):
    now = time.monotonic()
    return [Request(f"r{i}", tuple(range(3, 12 + i % 5)), answer, 16, now, now + 60) for i in range(n)]


def test_losing_a_host_under_load_moves_its_requests_and_loses_none():
    hosts = [_host("a"), _host("b")]
    cluster = _cluster(hosts)
    try:
        reqs = _requests(48)
        handles = [cluster.submit(r) for r in reqs]
        t_end = time.monotonic() + 10
        while not any(0 < r.committed < r.answer_length for r in reqs) and time.monotonic() < t_end:
            time.sleep(0.001)
        hosts[0][1].lose()  # every later call to host a fails, as a dead actor's would
        results = [h.result(30) for h in handles]
        assert all(r.state == RequestState.FINISHED_OK for r in results)
        assert [r.tokens for r in results] == [letter_answer(q.prompt_tokens, 64) for q in reqs]
        state = cluster.state()
        assert [i.state for i in state.instances if i.host == "a"] == ["failed", "failed"]
        assert state.migrations.get("failure", 0) >= 1 and sum(r.moves for r in results) >= 1
    finally:
        _stop(cluster, hosts)


def test_a_request_moved_between_hosts_streams_every_step_once_and_refreshes_first():
    hosts = [_host("a", step_s=0.003), _host("b", step_s=0.003)]
    cluster = _cluster(hosts)
    try:
        (r,) = _requests(1, answer=128)
        seen = []
        handle = cluster.submit(r, on_progress=seen.append, instance="a/tp1@0")
        t_end = time.monotonic() + 10
        while r.committed < 20 and time.monotonic() < t_end:
            time.sleep(0.001)
        assert cluster.migrate(r.id, "b/tp1@1")
        moved_at = len(r.steps)
        result = handle.result(30)
        assert result.tokens == letter_answer(r.prompt_tokens, 128) and result.instance == "b/tp1@1"
        assert len(seen) == result.steps == len(r.steps)  # one progress per step, none lost in the move
        assert sum(len(p.positions) for p in seen) == 128
        assert r.steps[moved_at].kind == StepKind.REFRESH and seen[moved_at].instance == "b/tp1@1"
    finally:
        _stop(cluster, hosts)


def test_the_hosts_step_metrics_reach_the_leader_with_their_host():
    from prometheus_client import generate_latest

    from dilaserve_jax.frontend.metrics import ServingMetrics

    totals = HostStepTotals()
    hosts = [_host("a", step_totals=totals), _host("b", step_totals=totals)]
    cluster = _cluster(hosts)
    cluster.host_steps = totals
    metrics = ServingMetrics(cluster)
    try:
        reqs = _requests(12)
        results = [h.result(30) for h in [cluster.submit(r) for r in reqs]]
        t_end = time.monotonic() + 5  # the last steps' counts come with a later poll than the results
        while sum(c.tokens.total for c in totals().values()) < 12 * 64 and time.monotonic() < t_end:
            time.sleep(0.01)
        counts = totals()
        assert set(counts) == {"a", "b"}
        assert sum(c.tokens.total for c in counts.values()) == 12 * 64  # every token committed once
        assert sum(c.tau.count for c in counts.values()) == sum(r.steps for r in results)
        assert all(set(c.seconds) == {"refresh", "reuse"} for c in counts.values())
        body = generate_latest(metrics.registry).decode()
        for host in ("a", "b"):
            assert f'dilaserve_step_seconds_count{{host="{host}",kind="reuse"}}' in body
            assert f'dilaserve_tokens_per_step_sum{{host="{host}"}} {counts[host].tokens.total}' in body
            assert f'dilaserve_tau_bucket{{host="{host}",le="+Inf"}} {float(counts[host].tau.count)}' in body
    finally:
        _stop(cluster, hosts)


def test_weights_loaded_on_every_host_swap_in_between_steps(tmp_path):
    hosts = [_host("a", step_s=0.003), _host("b", step_s=0.003)]
    cluster = _cluster(hosts)
    try:
        (long,) = _requests(1, answer=128)
        handle = cluster.submit(long, instance="a/tp1@0")
        t_end = time.monotonic() + 10
        while long.committed < 16 and time.monotonic() < t_end:
            time.sleep(0.001)
        params = {}
        for worker, _, _, _ in hosts:
            label, names = worker.load_weights(str(tmp_path), 3)
            params.update({f"{worker.host}/{n}": label for n in names})
        report = cluster.swap_in(NewWeights(label, params), timeout=10)
        assert set(report.swapped_at) == {e.name for e in cluster.engines} and cluster.model_source == label
        done = handle.result(30)
        assert done.tokens[:16] == letter_answer(long.prompt_tokens, 128)[:16]  # before the swap
        assert done.tokens != letter_answer(long.prompt_tokens, 128)  # its later steps ran on the new weights
        after = [h.result(30) for h in [cluster.submit(r) for r in _requests(8)]]
        assert [r.tokens for r in after] == [letter_answer(r.prompt_tokens, 64, weights=3) for r in _requests(8)]
        # a swap with nothing loaded on the host fails, as a one-process swap whose runner refuses
        try:
            cluster.swap_in(NewWeights("again", {e.name: "again" for e in cluster.engines}), timeout=10)
        except RuntimeError as err:
            assert "no weights were loaded" in str(err)
        else:
            raise AssertionError("a swap without loaded weights succeeded")
    finally:
        _stop(cluster, hosts)
