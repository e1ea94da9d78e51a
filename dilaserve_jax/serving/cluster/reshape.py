"""The actuator: reshape a running cluster into another layout, and move single requests.

A reconfiguration keeps every instance the new layout shares with the old one (same TP degree on
the same devices: its engine, weights and requests stay untouched) and replaces the others:

1. **Build** (old instances keep serving): the new instances' weights are resharded device to
   device from the old ones (`mesh.reshard`), their runners and engines built and started, and
   their executables warmed on their own engine threads — nothing compiles for a placement seen
   before. This needs the old and the new copies side by side; when the builder says the devices
   cannot hold both (`overlap_fits`), the removed instances are emptied first and the build happens
   while their requests wait ("pause" mode).
2. **Switch**: new requests are routed to the new set of instances from this moment; none is
   refused (while no instance is up, the cluster holds them).
3. **Hand-over**: each removed engine gives up its running and waiting requests at its next step
   boundary (running ones pass through MIGRATING with their canvas, block, τ ratio and steps).
4. **Re-admission** wherever the router places them; each one's next step is a refresh. Streams go
   on; the final response names the instance that finished. The removed engines stop and their
   weights are dropped.

Pure Python: it holds the cluster through the `Administered` / `ClusterAdmin` protocols
(serving/cluster/admin.py) and builds instances through `InstanceBuilder`, which
serving/executor/instances.py implements with JAX.
"""
from __future__ import annotations

import time
from concurrent.futures import wait
from dataclasses import dataclass, field
from typing import Sequence

from dilaserve_jax.core.layouts import layout_text
from dilaserve_jax.serving.cluster.admin import Administered, ClusterAdmin
from dilaserve_jax.serving.cluster.builder import InstanceBuilder, InstanceInfo
from dilaserve_jax.serving.cluster.engine import Engine
from dilaserve_jax.serving.cluster.engine_types import Handoff


@dataclass(frozen=True, slots=True)
class ReshapeReport:
    old: str
    new: str
    reason: str
    mode: str  # "overlap", "pause", or "none" when nothing changed
    kept: tuple[str, ...]
    added: tuple[str, ...]
    removed: tuple[str, ...]
    build_s: float = 0.0  # reshard + engines + warm-up (old instances serving meanwhile, in overlap mode)
    reshard_s: float = 0.0
    boundary_s: float = 0.0  # until every removed engine reached a step boundary and handed over
    readmit_s: float = 0.0
    total_s: float = 0.0
    bytes_moved: int = 0
    requests_moved: int = 0
    compiled: int = 0  # executables built during the switch
    finished_at: float = 0.0
    details: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return (f"{self.old} -> {self.new} ({self.reason}, {self.mode}): {self.total_s:.2f} s, "
                f"{self.bytes_moved / 2**20:.1f} MiB moved, {self.requests_moved} requests moved")


def reconfigure(cluster: Administered, spec: str, reason: str = "manual") -> ReshapeReport:
    builder = cluster.builder
    if builder is None:
        raise ValueError("this cluster cannot reshape its layout")
    infos = builder.plan(spec)  # ValueError for a bad spec, before holding the cluster
    with cluster.exclusive("reconfiguration") as admin:
        return _reconfigure(admin, builder, infos, spec, reason)


def _reconfigure(admin: ClusterAdmin, builder: InstanceBuilder, infos: Sequence[InstanceInfo], spec: str,
                 reason: str) -> ReshapeReport:
    t0 = time.perf_counter()
    old_text = admin.layout
    old = {e.name: e for e in admin.engines}
    keep = tuple(i.name for i in infos if i.name in old and old[i.name].healthy)
    add = [i for i in infos if i.name not in keep]
    remove = [e for e in admin.engines if e.name not in keep]
    if not add and not remove:
        return ReshapeReport(old_text, old_text, reason, "none", keep, (), ())
    describe = getattr(builder, "describe", None)  # a builder over several hosts writes each host's part
    new_text = describe(infos) if callable(describe) else layout_text([i.tp_degree for i in infos])
    compiled_before = _compile_count(builder)
    overlap = builder.overlap_fits(add)
    handoffs: list[Handoff] = []
    boundary_s = 0.0
    if not overlap:  # empty the removed instances first, so their memory is free for the new ones
        admin.retire(remove)
        handoffs, boundary_s = _hand_over(remove)
        for e in remove:
            e.stop()
    t_build = time.perf_counter()
    new_engines, moved, reshard_s = builder.build(add, spec)
    admin.adopt(new_engines)
    for e in new_engines:
        e.start()
        builder.prepare(e)
    build_s = time.perf_counter() - t_build
    by_name = {**old, **{e.name: e for e in new_engines}}
    admin.install([by_name[i.name] for i in infos], infos, new_text)  # new requests go to the new layout
    if overlap:
        handoffs, boundary_s = _hand_over(remove)
    t_readmit = time.perf_counter()
    admin.requeue(handoffs, "reconfigure", exclude=frozenset(e.name for e in remove))
    readmit_s = time.perf_counter() - t_readmit
    if overlap:
        for e in remove:
            e.stop()
    admin.forget([e.name for e in remove])
    builder.release([e.name for e in remove])
    report = ReshapeReport(old_text, new_text, reason, "overlap" if overlap else "pause", keep,
                           tuple(i.name for i in add), tuple(e.name for e in remove), build_s, reshard_s, boundary_s,
                           readmit_s, time.perf_counter() - t0, moved, len(handoffs),
                           _compile_count(builder) - compiled_before, admin.clock())
    admin.record_reconfiguration(report)
    admin.emit("reconfigure", {"from": old_text, "to": new_text, "seconds": report.total_s, "reason": reason})
    return report


def _hand_over(engines: Sequence[Engine]) -> tuple[list[Handoff], float]:
    t = time.perf_counter()
    futures = [e.hand_over() for e in engines if e.healthy]
    wait(futures, timeout=600)
    out = []
    for f in futures:
        if f.done() and f.exception() is None:
            out.extend(f.result())
    return out, time.perf_counter() - t


def migrate(cluster: Administered, request_id: str, target: str, reason: str, timeout: float) -> bool:
    """Move one request to `target` at its source's next step boundary."""
    source_name = cluster.instance_of(request_id)
    if not source_name or source_name == target:
        return False
    source = cluster.engine(source_name)
    try:
        handoffs = source.hand_over([request_id]).result(timeout)
    except Exception:  # noqa: BLE001 - the source failed meanwhile: its failure path moves the request
        return False
    if not handoffs:
        return False
    cluster.requeue(handoffs, reason, prefer=target)
    return True


def _compile_count(builder: InstanceBuilder) -> int:
    """Executables built so far, for builders that compile (optional in the protocol)."""
    count = getattr(builder, "compile_count", None)
    return int(count()) if callable(count) else 0
