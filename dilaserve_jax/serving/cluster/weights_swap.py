"""Swapping new weights into every serving instance of a cluster, between two of its steps.

`Cluster.reload` (weights loaded from a directory) and `Cluster.swap_in` (weights already placed,
e.g. pushed in memory by a training job) both end here. One administrative operation at a time:
a reload waits for, or refuses, a reconfiguration under way, and the other way round.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

from dilaserve_jax.serving.cluster.engine_types import EngineUnavailable

if TYPE_CHECKING:
    from dilaserve_jax.serving.cluster.cluster import Cluster


class WeightsError(ValueError):
    """New weights could not be read (missing, unreadable, corrupt, not a checkpoint)."""


class IncompatibleWeights(WeightsError):
    """New weights were read but do not fit the served model's architecture."""


@dataclass(frozen=True, slots=True)
class NewWeights:
    """Weights loaded for a reload: a label for the source, and params placed per instance name."""

    source: str
    params: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class ReloadReport:
    source: str
    seconds: float
    swapped_at: Mapping[str, float]  # instance -> engine-clock time of its swap


def swap_weights(cluster: Cluster, make: Callable[[], NewWeights], timeout: float | None, wait_s: float | None,
                 origin: str) -> ReloadReport:
    """Take the cluster's administration lock (wait up to `wait_s`; None: raise ClusterBusy at once),
    get the weights from `make()` and swap them into every healthy engine. An engine that fails
    meanwhile is skipped (its requests moved to the others); the loader's errors pass through and
    the old weights keep serving."""
    from dilaserve_jax.serving.cluster.cluster import ClusterBusy

    admin = cluster._admin
    got = admin.acquire(blocking=False) if wait_s is None else admin.acquire(timeout=wait_s)
    if not got:
        raise ClusterBusy("another reload or reconfiguration is in progress")
    try:
        t0 = time.perf_counter()
        new = make()
        missing = sorted({e.name for e in cluster.healthy_engines} - set(new.params))
        if missing:
            raise WeightsError(f"the new weights hold no params for instance(s) {missing}")
        swaps = {e.name: e.swap_weights(new.params[e.name]) for e in cluster.healthy_engines}
        swapped = {}
        for name, fut in swaps.items():
            try:
                swapped[name] = fut.result(timeout)
            except EngineUnavailable:  # failed meanwhile; its requests moved to the others
                pass
        cluster.model_source = new.source
        cluster.reloads += 1
        cluster.weight_updates[origin] = cluster.weight_updates.get(origin, 0) + 1
        report = ReloadReport(new.source, time.perf_counter() - t0, swapped)
        cluster._emit("reload", {"source": new.source, "seconds": report.seconds, "origin": origin})
        return report
    finally:
        admin.release()
