"""Reconfiguring a multi-host server: the `InstanceBuilder` the leader's cluster reshapes with.

A layout names one layout per host, joined by '|' in the order the cluster's layout lists them
("2x4|8": host 1 two TP-4 instances, host 2 one TP-8). Each host plans, builds (resharding its
weights device to device on its own devices) and drops its own instances, the changed hosts
building at the same time; a TP group never spans hosts. Everything else is the cluster's
reshape (serving/cluster/reshape.py) run at the leader: a host whose part is unchanged keeps its instances and their requests untouched, removed instances
hand their requests over at a step boundary, and the router places them on the new set, next
step a refresh.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from dilaserve_jax.serving.cluster.builder import InstanceInfo
from dilaserve_jax.serving.cluster.hosts.link import RayTransport
from dilaserve_jax.serving.cluster.hosts.remote_engine import RemoteEngine

if TYPE_CHECKING:
    from dilaserve_jax.serving.cluster.hosts.ray_hosts import RayHosts


def hosts_layout(infos: Sequence[InstanceInfo]) -> str:
    """Each host's layout, hosts joined by '|' in the order they first appear ("2x1|2")."""
    from dilaserve_jax.core.layouts import layout_text

    by_host: dict[str, list[int]] = {}
    for info in infos:
        by_host.setdefault(info.host, []).append(info.tp_degree)
    return "|".join(layout_text(tps) for tps in by_host.values())


class HostsBuilder:
    def __init__(self, hosts: "RayHosts") -> None:
        self.hosts = hosts

    def live_hosts(self) -> list[str]:
        """Every live host, in the order a layout lists their parts."""
        return [h for h, _ in self._live()]

    def actor(self, host: str):
        """The worker actor of a live host."""
        return self._actor(host)

    def _live(self) -> list[tuple[str, object]]:
        """(host, link) of every live host, in the order of the cluster's layout."""
        links = {link.host: link for link in self.hosts.links.values() if link.lost is None}
        order = list(dict.fromkeys(i.host for i in self.hosts.cluster.infos))
        return [(h, links[h]) for h in order + sorted(set(links) - set(order)) if h in links]

    def _actor(self, host: str):
        return next(self.hosts.actors[node] for node, link in self.hosts.links.items() if link.host == host)

    def _parts(self, spec: str) -> dict[str, str]:
        live = self._live()
        parts = [p.strip() for p in spec.split("|")]
        if len(parts) != len(live):
            raise ValueError(f"layout {spec!r} has {len(parts)} part(s) but {len(live)} host(s) serve "
                             f"({', '.join(h for h, _ in live)}): one layout per host, joined by '|'")
        return {h: p for (h, _), p in zip(live, parts)}

    def plan(self, spec: str) -> list[InstanceInfo]:
        out = []
        for host, part in self._parts(spec).items():
            for i in RayTransport._get(self._actor(host).plan.remote(part)):
                out.append(InstanceInfo(f"{host}/{i.name}", i.tp_degree, i.device_ids, host))
        return out

    def overlap_fits(self, add: Sequence[InstanceInfo]) -> bool:
        return all(RayTransport._get(self._actor(host).overlap_fits.remote(local))
                   for host, local in _by_host(add).items())

    def build(self, add: Sequence[InstanceInfo], spec: str) -> tuple[list[RemoteEngine], int, float]:
        parts, links = self._parts(spec), dict(self._live())
        engines, moved, reshard_s = [], 0, 0.0
        by_host = _by_host(add)
        builds = {host: self._actor(host).build.remote(local, parts[host]) for host, local in by_host.items()}
        for host, local in by_host.items():  # the hosts build at once, each on its own devices
            snaps, m, s = RayTransport._get(builds[host])
            link = links[host]
            new = [RemoteEngine(link, i.name, f"{host}/{i.name}", snaps[i.name]) for i in local]
            link.attach([*link.engines.values(), *new])
            engines += new
            moved, reshard_s = moved + m, max(reshard_s, s)
        return engines, moved, reshard_s

    def prepare(self, engine: RemoteEngine) -> None:
        pass  # its host warmed it while building

    def release(self, names: Sequence[str]) -> None:
        serving = {i.name for i in self.hosts.cluster.infos}  # a failed instance rebuilt under its name stays
        infos = [InstanceInfo(n, 0, (), n.split("/", 1)[0]) for n in names if "/" in n and n not in serving]
        live = dict(self._live())
        for host, local in _by_host(infos).items():
            link = live.get(host)
            if link is None:  # a lost host's instances: nothing to drop there
                continue
            RayTransport._get(self._actor(host).release.remote([i.name for i in local]))
            link.attach([e for e in link.engines.values() if e.local_name not in {i.name for i in local}])

    def compiled_placements(self) -> frozenset[tuple[int, int]]:
        return frozenset()

    def describe(self, infos: Sequence[InstanceInfo]) -> str:
        return hosts_layout(infos)


def _by_host(infos: Sequence[InstanceInfo]) -> dict[str, list[InstanceInfo]]:
    """The instances of each host, with their names on that host."""
    out: dict[str, list[InstanceInfo]] = {}
    for i in infos:
        local = i.name.split("/", 1)[1] if "/" in i.name else i.name
        out.setdefault(i.host, []).append(InstanceInfo(local, i.tp_degree, i.device_ids, i.host))
    return out
