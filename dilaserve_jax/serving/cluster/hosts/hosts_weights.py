"""Reloading weights across hosts: the leader cluster's loader (`ReloadWeights`, `Cluster.reload`).

A one-process reload loads the new weights onto every instance's devices, then swaps them into
each instance between two of its steps (serving/cluster/weights_swap.py). Across hosts the same
swap runs at the leader unchanged, over a loader that works in two phases:

1. **Load everywhere.** Every live host's worker reads the weights itself (from the same path:
   the hosts need the directory at the same place, as they do `--model`) and places them on its
   own instances, all hosts at once. If any host cannot (a missing step, another architecture,
   the host lost meanwhile), every host that did puts its previous weights back and the reload
   fails with that host's error: the old weights keep serving everywhere, as in one process.
2. **Swap.** The leader's swap asks each instance, through its `RemoteEngine`, to swap in what its
   host loaded; requests in flight continue on the new weights from a refresh step. An instance
   that fails meanwhile is skipped, its requests moved, as in one process.

A host that joins later builds its instances from `--model`; the leader then reloads the weights
last loaded onto it before its instances take requests (`bring_up_to_date`), so every host serves
the same weights.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from dilaserve_jax.serving.cluster.hosts.link import RayTransport
from dilaserve_jax.serving.cluster.weights_swap import NewWeights

if TYPE_CHECKING:
    from dilaserve_jax.serving.cluster.hosts.ray_hosts import RayHosts

log = logging.getLogger(__name__)


class HostsWeights:
    def __init__(self, hosts: "RayHosts") -> None:
        self.hosts = hosts
        self.last: tuple[str, int | None] | None = None  # (source, step) of the last load every host took

    def load(self, source: str, step: int | None) -> NewWeights:
        """Phase 1 on every live host; the NewWeights name each remote instance (its params are
        only the label: the arrays stay on their hosts)."""
        builder = self.hosts.cluster.builder
        calls = {host: builder.actor(host).load_weights.remote(source, step) for host in builder.live_hosts()}
        loaded, error = {}, None
        for host, ref in calls.items():
            try:
                loaded[host] = RayTransport._get(ref)
            except Exception as err:  # noqa: BLE001 - reported below, after the others are undone
                log.error("host %s could not load weights from %s: %s", host, source, err)
                error = error or err
        if error is not None:
            for host in loaded:
                try:
                    RayTransport._get(builder.actor(host).undo_weights.remote())
                except Exception:  # noqa: BLE001 - a host lost meanwhile serves nothing
                    log.exception("host %s: putting the previous weights back failed", host)
            raise error
        if not loaded:
            raise ValueError("no live host to load weights on")
        self.last = (source, step)
        label = next(iter(loaded.values()))[0]
        return NewWeights(label, {f"{host}/{name}": label for host, (_, names) in loaded.items() for name in names})

    def bring_up_to_date(self, actor) -> None:
        """A joining host's worker: load and swap in the weights last loaded, if any, before it serves."""
        if self.last is not None:
            RayTransport._get(actor.reload_now.remote(*self.last))
