"""Placement: each request goes to the healthy instance with the earliest predicted finish.

The prediction reads only an instance's published `EngineSnapshot`: the predicted time left of
its running and queued requests, the work submitted but not yet scheduled, and the new request's
own time at τ_max from that instance's latency model and TP degree — so a wide (high-TP) instance
wins at low load and the least-loaded narrow one at high load. Failed or stopped instances are
never chosen. Pure Python over snapshots (the simulator reuses it).
"""
from __future__ import annotations

import heapq
from typing import Sequence

from dilaserve_jax.serving.policy.snapshots import EngineSnapshot, own_time
from dilaserve_jax.serving.policy.request import Request


class NoInstanceAvailable(RuntimeError):
    """Every instance has failed or stopped."""


def predict_finish(snap: EngineSnapshot, request: Request, now: float) -> float:
    """Predicted finish of `request` if sent to this instance now (queue + its own time at τ_max)."""
    load = snap.load
    slots = [max(0.0, t - (now - load.time)) for t in load.running_left]
    slots += [0.0] * max(0, load.num_slots - len(slots))
    heapq.heapify(slots)
    for w in (*load.waiting_left, *snap.pending):  # FIFO approximation of the queue
        heapq.heappush(slots, heapq.heappop(slots) + w)
    return now + heapq.heappop(slots) + own_time(load, request)


class Router:
    """Chooses among instances by their snapshots; keeps no state of its own."""

    def choose(self, snapshots: Sequence[EngineSnapshot], request: Request, now: float,
               exclude: frozenset[str] = frozenset()) -> str:
        """Name of the instance to send `request` to."""
        healthy = [s for s in snapshots if s.healthy and s.name not in exclude]
        if not healthy:
            down = "; ".join(f"{s.name}: " + ("unavailable" if s.healthy else s.state.name.lower())
                             + (f" ({s.error})" if s.error else "") for s in snapshots)
            raise NoInstanceAvailable(f"no instance is serving ({down or 'none configured'})")
        return min(healthy, key=lambda s: predict_finish(s, request, now)).name
