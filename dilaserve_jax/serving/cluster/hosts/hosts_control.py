"""The cluster controller of a leader over hosts: what it sees of them, and starting it.

Each host's worker, once warm, sends what the controller needs of it (`ControlInputs`: its device
count, a latency model for every TP degree its devices can hold, its slots, the model's bytes,
the τ floor and prior). The leader runs one `HostsController` over every live host
(serving/policy/hosts_controller.py) in the ordinary `Autoscaler`, so its rounds, modes
(`auto`, `paused`) and migrations are one-process serving's; a layout switch goes through
`Cluster.reconfigure` with one part per host, which reshapes only the hosts whose part changed.
The hosts are assumed alike: each TP degree is priced with the first host's latency model.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from dilaserve_jax.serving.cluster.autoscale import Autoscaler
from dilaserve_jax.serving.policy.controller import ControllerConfig
from dilaserve_jax.serving.policy.hosts_controller import HostsController, HostSlice

if TYPE_CHECKING:
    from dilaserve_jax.serving.cluster.hosts.ray_hosts import RayHosts


def host_slices(hosts: "RayHosts") -> list[HostSlice]:
    """Every live host, in the order a layout lists them: its devices and its instances' TP degrees."""
    cluster = hosts.cluster
    out = []
    for host in cluster.builder.live_hosts():
        tps = tuple(sorted((i.tp_degree for i in cluster.infos if i.host == host), reverse=True))
        info = hosts.host_infos.get(host)
        devices = info.control.devices if info is not None and info.control is not None else sum(tps)
        out.append(HostSlice(host, devices, tps))
    return out


def hosts_controller(hosts: "RayHosts", cfg: ControllerConfig, layouts: Sequence[str] = ()) -> HostsController:
    inputs = [i.control for i in hosts.host_infos.values() if i.control is not None]
    if not inputs:
        raise ValueError("no host sent what the controller needs (its workers were built without a controller)")
    latency = {}
    for c in inputs:
        for tp, model in c.latency.items():
            latency.setdefault(tp, model)
    first = inputs[0]
    return HostsController(cfg, hosts=lambda: host_slices(hosts), tp_degrees=sorted(latency), latency=latency,
                           slots=first.slots, param_bytes=first.param_bytes, layouts=layouts or None,
                           tau_floor=first.tau_floor, prior=dict(first.prior) or None, shapes=first.shapes,
                           pressure_share=first.pressure_share)


def start_hosts_controller(hosts: "RayHosts", cfg: ControllerConfig, mode: str = "auto",
                           layouts: Sequence[str] = ()) -> HostsController:
    """Run the controller over the hosts in the cluster's autoscaler (`mode`: auto or paused)."""
    if mode not in ("auto", "paused"):
        raise ValueError(f"the controller across hosts runs auto or paused, not {mode!r}")
    ctl = hosts_controller(hosts, cfg, layouts)
    hosts.cluster.autoscaler = Autoscaler(hosts.cluster, None, mode=mode)
    hosts.cluster.autoscaler.set_controller(ctl)
    return ctl
