"""Prometheus metrics of a serving cluster, served over HTTP on --metrics-port."""
from __future__ import annotations

from typing import Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily
from prometheus_client.utils import floatToGoString

from dilaserve_jax.serving.cluster.hosts.step_tally import STEP_BUCKETS, TAU_BUCKETS, TOKEN_BUCKETS, Buckets
from dilaserve_jax.serving.cluster.protocol import ServingCluster

__all__ = ["ServingMetrics", "STEP_BUCKETS", "TAU_BUCKETS", "TOKEN_BUCKETS"]
STEP_HELP = "Denoising step latency"
TAU_HELP = "Threshold used per request step"
TOKENS_HELP = "Tokens committed per request step"


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
        pressure = GaugeMetricFamily("dilaserve_arrival_pressure", "1 while deadlines are being lost to load and the "
                                     "budget's spare allowance lowers tau for throughput", labels=labels)
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
            pressure.add_metric(where(inst), 1.0 if q.pressure else 0.0)
        yield from (budget, loss_mean, loss_spent, mean_tau, pressure)
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


class _HostStepCollector:
    """The step histograms of instances on other hosts, from the counts their workers sent
    (serving/cluster/hosts/step_tally.py): the one-process series with a `host` label."""

    def __init__(self, totals) -> None:
        self.totals = totals  # () -> {host: StepCounts}

    def collect(self):
        seconds = HistogramMetricFamily("dilaserve_step_seconds", STEP_HELP, labels=["kind", "host"])
        tau = HistogramMetricFamily("dilaserve_tau", TAU_HELP, labels=["host"])
        tokens = HistogramMetricFamily("dilaserve_tokens_per_step", TOKENS_HELP, labels=["host"])
        for host, counts in sorted(self.totals().items()):
            for kind, buckets in sorted(counts.seconds.items()):
                seconds.add_metric([kind, host], _cumulative(buckets), buckets.total)
            tau.add_metric([host], _cumulative(counts.tau), counts.tau.total)
            tokens.add_metric([host], _cumulative(counts.tokens), counts.tokens.total)
        yield from (seconds, tau, tokens)


def _cumulative(buckets: Buckets) -> list[tuple[str, int]]:
    return [(floatToGoString(bound), n) for bound, n in buckets.cumulative()]


class ServingMetrics:
    def __init__(self, cluster: ServingCluster | None = None, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("dilaserve_requests", "Finished calls by outcome", ["outcome"], registry=r)
        self.deadlines = Counter("dilaserve_deadlines", "Completed requests by deadline result", ["result"], registry=r)
        host_steps = getattr(cluster, "host_steps", None)  # a leader over other hosts: they count the steps
        if host_steps is None:
            self.step_seconds = Histogram("dilaserve_step_seconds", STEP_HELP, ["kind"], buckets=STEP_BUCKETS,
                                          registry=r)
            self.tau = Histogram("dilaserve_tau", TAU_HELP, buckets=TAU_BUCKETS, registry=r)
            self.tokens_per_step = Histogram("dilaserve_tokens_per_step", TOKENS_HELP, buckets=TOKEN_BUCKETS,
                                             registry=r)
        else:
            self.step_seconds = self.tau = self.tokens_per_step = None
            r.register(_HostStepCollector(host_steps))
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
        if self.step_seconds is None:  # no engine here (a leader over other hosts)
            return
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
