"""Swapping new weights into every serving instance of a cluster, between two of its steps.

`Cluster.reload` (weights loaded from a directory) and `Cluster.swap_in` (weights already placed,
e.g. pushed in memory by a training job) both end here. One administrative operation at a time:
a reload waits for, or refuses, a reconfiguration under way, and the other way round. Pure: it
holds the cluster through the `Administered` / `ClusterAdmin` protocols (serving/cluster/admin.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from dilaserve_jax.serving.cluster.admin import Administered
from dilaserve_jax.serving.cluster.engine_types import EngineUnavailable


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


def swap_weights(cluster: Administered, make: Callable[[], NewWeights], timeout: float | None,
                 wait_s: float | None, origin: str) -> ReloadReport:
    """Hold the cluster (wait up to `wait_s`; None: raise ClusterBusy at once), get the weights from
    `make()` and swap them into every healthy engine. An engine that fails meanwhile is skipped (its
    requests moved to the others); the loader's errors pass through and the old weights keep serving."""
    with cluster.exclusive("reload", wait_s) as admin:
        t0 = time.perf_counter()
        new = make()
        missing = sorted({e.name for e in admin.healthy_engines} - set(new.params))
        if missing:
            raise WeightsError(f"the new weights hold no params for instance(s) {missing}")
        swaps = {e.name: e.swap_weights(new.params[e.name]) for e in admin.healthy_engines}
        swapped = {}
        for name, fut in swaps.items():
            try:
                swapped[name] = fut.result(timeout)
            except EngineUnavailable:  # failed meanwhile; its requests moved to the others
                pass
        admin.weights_swapped(new.source, origin)
        report = ReloadReport(new.source, time.perf_counter() - t0, swapped)
        admin.emit("reload", {"source": new.source, "seconds": report.seconds, "origin": origin})
        return report
