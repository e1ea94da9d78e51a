"""Serving across many hosts with Ray: one worker actor per node, one cluster at the leader.

The leader (this process: the frontends, the router, the request table, the cluster) connects to
a Ray cluster and starts one `HostWorker` actor on every alive node, pinned there with a hard
node-affinity strategy; the actor builds that host's engines over its own devices (a TP group
never spans hosts). The leader sees each remote instance through a `RemoteEngine`, so the
`Cluster` routes, migrates and re-queues across hosts with its own code. Ray carries the calls
and tells us when a worker dies (the call in flight raises `RayActorError`); that host's
instances are marked failed and their requests continue on the survivors. A joiner thread looks
for alive nodes without a live worker (a new node, or one whose worker died) and starts one; its
instances join the serving set. Weight reloads load on every host and swap at the leader
(hosts_weights.py); the hosts' step metrics add up in `step_totals` (step_tally.py).

Ray is imported only here, inside functions, so the package imports without it.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Sequence

from dilaserve_jax.core.layouts import layout_text
from dilaserve_jax.serving.cluster.builder import InstanceInfo
from dilaserve_jax.serving.cluster.cluster import Cluster
from dilaserve_jax.serving.cluster.hosts.hosts_builder import HostsBuilder, hosts_layout
from dilaserve_jax.serving.cluster.hosts.hosts_weights import HostsWeights
from dilaserve_jax.serving.cluster.hosts.link import HostLink, RayTransport
from dilaserve_jax.serving.cluster.hosts.remote_engine import HostLost, RemoteEngine
from dilaserve_jax.serving.cluster.hosts.step_tally import HostStepTotals
from dilaserve_jax.serving.cluster.hosts.worker import HostFactory, HostInfo, HostWorker

log = logging.getLogger(__name__)


def alive_nodes() -> list[dict]:
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


def host_name(node: dict) -> str:
    """Readable and unique: the node's address and the start of its id (one machine may run several)."""
    return f"{node['NodeManagerAddress']}-{node['NodeID'][:6]}"


class RayHosts:
    def __init__(self, factory: HostFactory, *, poll_wait_s: float = 0.05, join_interval_s: float = 1.0,
                 watchdog_s: float | None = None, env_vars: dict[str, str] | None = None,
                 node_ids: Sequence[str] | None = None, say: Callable[[str], None] = log.info) -> None:
        """`env_vars`: set in every worker process before it builds anything (e.g. XLA_FLAGS);
        `node_ids`: the Ray nodes to serve on (default: every alive one, and any that joins)."""
        self.node_ids = None if node_ids is None else frozenset(node_ids)
        self.factory, self.poll_wait_s, self.join_interval_s = factory, poll_wait_s, join_interval_s
        self.watchdog_s, self.env_vars, self.say = watchdog_s, dict(env_vars or {}), say
        self.links: dict[str, HostLink] = {}  # node id -> its latest link
        self.actors: dict[str, Any] = {}
        self.host_infos: dict[str, HostInfo] = {}  # by host: what its latest worker said of itself
        self.step_totals = HostStepTotals()  # every host's step metrics
        self.weights = HostsWeights(self)
        self.cluster: Cluster | None = None
        self.joins = 0  # hosts that joined after start-up
        self._stop = threading.Event()
        self._joiner: threading.Thread | None = None

    # --- start-up ---
    def start(self, **cluster_kw) -> Cluster:
        """Start a worker on every alive node (in parallel), then the leader's cluster over them."""
        nodes = self._nodes()
        if not nodes:
            raise RuntimeError("the Ray cluster has no alive node")
        started = [(node, self._launch(node)) for node in nodes]
        joined = [self._connect(node, actor) for node, actor in started]
        engines = [e for es, _, _ in joined for e in es]
        infos = [i for _, ins, _ in joined for i in ins]
        first: HostInfo = joined[0][2]
        self.cluster = Cluster(engines, infos, layout=hosts_layout(infos), policy=first.policy,
                               model_source=first.model_source, tokenizer=first.tokenizer, limits=first.limits,
                               family=first.family, builder=HostsBuilder(self), loader=self.weights.load,
                               **cluster_kw)
        self.cluster.host_steps = self.step_totals
        for link in self.links.values():
            link.start()
        self._joiner = threading.Thread(target=self._join_loop, name="ray-hosts-joiner", daemon=True)
        self._joiner.start()
        return self.cluster

    def _nodes(self) -> list[dict]:
        return [n for n in alive_nodes() if self.node_ids is None or n["NodeID"] in self.node_ids]

    def _launch(self, node: dict):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        actor_cls = ray.remote(HostWorker)
        options = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
                   "num_cpus": 0, "max_concurrency": 8, "max_restarts": 0}
        if self.env_vars:
            options["runtime_env"] = {"env_vars": self.env_vars}
        self.say(f"starting the worker of host {host_name(node)}")
        return actor_cls.options(**options).remote(host_name(node), self.factory, self.watchdog_s)

    def _connect(self, node: dict, actor) -> tuple[list[RemoteEngine], list[InstanceInfo], HostInfo]:
        import ray

        info: HostInfo = ray.get(actor.info.remote())  # waits for its engines to be built and warm
        ray.get(actor.set_clock_offset.remote(_clock_offset(actor)))
        _, snapshots = ray.get(actor.poll.remote(0.0))
        link = HostLink(info.host, RayTransport(actor), self.poll_wait_s, step_totals=self.step_totals)
        engines, infos = [], []
        for local in info.infos:
            name = f"{info.host}/{local.name}"
            engines.append(RemoteEngine(link, local.name, name, snapshots[local.name]))
            infos.append(InstanceInfo(name, local.tp_degree, local.device_ids, info.host))
        link.attach(engines)
        self.links[node["NodeID"]], self.actors[node["NodeID"]] = link, actor
        self.host_infos[info.host] = info
        self.say(f"host {info.host} (pid {info.pid}): {len(engines)} instance(s) "
                 f"{layout_text([i.tp_degree for i in infos])}")
        return engines, infos, info

    # --- hosts joining while serving ---
    def _join_loop(self) -> None:
        while not self._stop.wait(self.join_interval_s):
            try:
                self.join_new_hosts()
            except (Exception, SystemExit):  # noqa: BLE001 - try again next round
                # ray.get can raise SystemExit in this thread (seen while a loaded machine started
                # the worker); ending the thread would stop every later join
                log.exception("adding a host failed")

    def join_new_hosts(self) -> int:
        """Start a worker on every alive node without a live one and add its instances; returns how many."""
        joined = 0
        for node in self._nodes():
            link = self.links.get(node["NodeID"])
            if self._stop.is_set() or (link is not None and link.lost is None):
                continue
            actor = self._launch(node)
            try:
                engines, infos, _ = self._connect(node, actor)
            except BaseException:
                _kill(actor)  # half started: the next round launches a fresh one
                raise
            try:
                self.weights.bring_up_to_date(actor)
            except Exception as err:  # noqa: BLE001 - not admitted; a new worker is tried next round
                log.exception("host %s could not load the weights the others serve", infos[0].host if infos else "?")
                self.links[node["NodeID"]]._lose(HostLost(f"could not load the served weights: {err}"))
                _kill(actor)
                continue
            self._admit(engines, infos)
            self.links[node["NodeID"]].start()
            joined += 1
            self.joins += 1
        return joined

    def _admit(self, engines: Sequence[RemoteEngine], infos: Sequence[InstanceInfo]) -> None:
        """Add a host's instances to the serving set, in place of that host's failed ones (its
        previous worker's: they stay in `failures`)."""
        cluster = self.cluster
        host = infos[0].host if infos else ""
        with cluster.exclusive("host join", wait_s=60.0) as admin:
            admin.adopt(engines)
            for e in engines:
                e.start()
            old = [(e, i) for e, i in zip(admin.engines, cluster.infos) if i.host != host]
            gone = [i.name for e, i in zip(admin.engines, cluster.infos) if i.host == host]
            all_engines = [e for e, _ in old] + list(engines)
            all_infos = [i for _, i in old] + list(infos)
            admin.install(all_engines, all_infos, hosts_layout(all_infos))
            admin.forget(gone)
        self.say(f"host {host} joined: now serving {cluster.layout}")

    # --- shutdown ---
    def stop(self) -> None:
        self._stop.set()
        if self._joiner is not None:
            self._joiner.join(10)
        if self.cluster is not None:
            self.cluster.stop()
        for link in self.links.values():
            link.stop()
        for actor in self.actors.values():
            _kill(actor)


def _kill(actor) -> None:
    import ray

    try:
        ray.kill(actor)
    except Exception:  # noqa: BLE001 - already gone
        pass


def _clock_offset(actor, samples: int = 5) -> float:
    """Leader monotonic time minus the worker's, from the round trip with the shortest time."""
    import ray

    best = None
    for _ in range(samples):
        t0 = time.monotonic()
        there = ray.get(actor.monotonic.remote())
        t1 = time.monotonic()
        if best is None or t1 - t0 < best[0]:
            best = (t1 - t0, (t0 + t1) / 2 - there)
    return best[1]
