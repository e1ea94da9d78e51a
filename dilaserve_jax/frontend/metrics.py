"""Prometheus metrics of a serving cluster, served over HTTP on --metrics-port."""
from __future__ import annotations

from typing import Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from dilaserve_jax.serving.cluster.protocol import ServingCluster

TAU_BUCKETS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0)
TOKEN_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _ClusterCollector:
    """Reads queue length, running requests and the layout from the cluster's state at scrape time."""

    def __init__(self, cluster: ServingCluster):
        self.cluster = cluster

    def collect(self):
        state = self.cluster.state()
        # a `host` label only when instances run on several hosts, so one-process series keep their names
        hosted = any(inst.host for inst in state.instances)
        labels = ["instance", "host"] if hosted else ["instance"]

        def where(inst) -> list[str]:
            return [inst.name, inst.host] if hosted else [inst.name]

        queue = GaugeMetricFamily("dilaserve_queue_length", "Requests waiting for a slot", labels=labels)
        running = GaugeMetricFamily("dilaserve_running_requests", "Requests holding a slot", labels=labels)
        up = GaugeMetricFamily("dilaserve_instance_up", "1 while the instance serves, 0 once failed or stopped",
                               labels=labels)
        for inst in state.instances:
            queue.add_metric(where(inst), inst.waiting)
            running.add_metric(where(inst), inst.running)
            up.add_metric(where(inst), 1.0 if inst.up else 0.0)
        budget = GaugeMetricFamily("dilaserve_accuracy_budget_points", "Max mean predicted accuracy drop (points "
                                   "vs the tau ceiling); absent when unbounded", labels=labels)
        loss_mean = GaugeMetricFamily("dilaserve_predicted_loss_points_mean", "Mean predicted accuracy loss over "
                                      "the requests served", labels=labels)
        loss_spent = GaugeMetricFamily("dilaserve_predicted_loss_points_spent", "Total predicted accuracy loss, "
                                       "served and running requests", labels=labels)
        mean_tau = GaugeMetricFamily("dilaserve_mean_tau", "Mean threshold over every step run", labels=labels)
        for inst in state.instances:
            q = inst.quality
            if q is None:
                continue
            if q.budget is not None:
                budget.add_metric(where(inst), q.budget)
            loss_mean.add_metric(where(inst), q.predicted_loss_mean)
            loss_spent.add_metric(where(inst), q.predicted_loss_spent)
            if q.mean_tau is not None:
                mean_tau.add_metric(where(inst), q.mean_tau)
        yield from (budget, loss_mean, loss_spent, mean_tau)
        layout = InfoMetricFamily("dilaserve_layout", "Current device layout and policy")
        layout.add_metric([], {"layout": state.layout, "policy": state.policy, "model": state.model})
        per_tp = GaugeMetricFamily("dilaserve_layout_instances", "Instances of the current layout by TP degree",
                                   labels=["tp"])
        counts: dict[int, int] = {}
        for inst in state.instances:
            counts[inst.tp_degree] = counts.get(inst.tp_degree, 0) + 1
        for tp, n in sorted(counts.items()):
            per_tp.add_metric([str(tp)], n)
        yield from (queue, running, up, layout, per_tp)
        updates = CounterMetricFamily("dilaserve_weight_updates", "Weight swaps by origin (reload call, in-memory "
                                      "push, checkpoint watcher)", labels=["origin"])
        for origin, count in state.weight_updates.items():
            updates.add_metric([origin], count)
        yield updates
        watch = state.checkpoint_watch
        if watch is not None:
            yield GaugeMetricFamily("dilaserve_checkpoint_watch_step", "Newest training step the checkpoint "
                                    "watcher swapped in (-1 before any)", value=watch.last_step)
            yield CounterMetricFamily("dilaserve_checkpoint_watch_reloads", "Training steps the checkpoint "
                                      "watcher swapped in", value=watch.reloads)
            yield CounterMetricFamily("dilaserve_checkpoint_watch_skipped", "Finalized training steps the "
                                      "checkpoint watcher could not read and skipped", value=watch.skipped)


class ServingMetrics:
    def __init__(self, cluster: ServingCluster | None = None, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("dilaserve_requests", "Finished calls by outcome", ["outcome"], registry=r)
        self.deadlines = Counter("dilaserve_deadlines", "Completed requests by deadline result", ["result"], registry=r)
        self.step_seconds = Histogram("dilaserve_step_seconds", "Denoising step latency", ["kind"],
                                      buckets=STEP_BUCKETS, registry=r)
        self.tau = Histogram("dilaserve_tau", "Threshold used per request step", buckets=TAU_BUCKETS, registry=r)
        self.tokens_per_step = Histogram("dilaserve_tokens_per_step", "Tokens committed per request step",
                                         buckets=TOKEN_BUCKETS, registry=r)
        self.failures = Counter("dilaserve_instance_failures", "Instances that failed (runner fault, dead loop, "
                                "watchdog)", ["instance"], registry=r)
        self.migrations = Counter("dilaserve_migrations", "Requests moved between instances", ["reason"], registry=r)
        self.reloads = Counter("dilaserve_weight_reloads", "Weight reloads swapped in", registry=r)
        self.reconfigurations = Counter("dilaserve_reconfigurations", "Layout switches", ["from", "to"], registry=r)
        self.reconfigure_seconds = Histogram("dilaserve_reconfigure_seconds", "Duration of a layout switch",
                                             buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300), registry=r)
        if cluster is not None:
            r.register(_ClusterCollector(cluster))
        self._http = None

    def step_hook(self, name: str, plan, outcomes: Sequence, t0: float, t1: float) -> None:
        """Engine step hook (runs on the engine thread)."""
        self.step_seconds.labels(kind=plan.kind.label).observe(t1 - t0)
        for tau, outcome in zip(plan.taus, outcomes):
            self.tau.observe(tau)
            self.tokens_per_step.observe(outcome.n_committed)

    def cluster_event(self, event: str, details: dict) -> None:
        """Cluster listener (runs on an engine or watchdog thread)."""
        if event == "failure":
            self.failures.labels(instance=details["instance"]).inc()
        elif event == "migration":
            self.migrations.labels(reason=details["reason"]).inc(details["count"])
        elif event == "reload":
            self.reloads.inc()
        elif event == "reconfigure":
            self.reconfigurations.labels(**{"from": details["from"], "to": details["to"]}).inc()
            self.reconfigure_seconds.observe(details["seconds"])

    def finished(self, outcome: str, deadline_met: bool | None = None) -> None:
        self.requests.labels(outcome=outcome).inc()
        if deadline_met is not None:
            self.deadlines.labels(result="met" if deadline_met else "missed").inc()

    def cancelled(self) -> None:
        self.finished("cancelled")

    def serve_http(self, port: int, host: str = "127.0.0.1") -> int:
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._http = server
        return server.server_address[1]

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http = None
