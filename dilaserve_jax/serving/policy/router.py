"""Placement: each request goes to the healthy instance with the earliest predicted finish.

The prediction reads only an instance's published `EngineSnapshot`: the predicted time left of
its running and queued requests, the work submitted but not yet scheduled, and the new request's
own time at τ_max from that instance's latency model and TP degree — so a wide (high-TP) instance
wins at low load and the least-loaded narrow one at high load. Failed or stopped instances are
never chosen. Pure Python over snapshots (the simulator reuses it).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

from dilaserve_jax.serving.policy.snapshots import EngineSnapshot, own_time
from dilaserve_jax.serving.policy.request import Request


class NoInstanceAvailable(RuntimeError):
    """Every instance has failed or stopped."""


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request goes, and its own predicted seconds there (the estimate the instance then
    counts as pending work, so it is computed once per submit)."""

    instance: str
    own_seconds: float
    finish: float


def placement(snap: EngineSnapshot, request: Request, now: float) -> Placement:
    """`request` sent to this instance now: its own time at τ_max and its predicted finish
    (the queue ahead of it, then its own time)."""
    load = snap.load
    slots = [max(0.0, t - (now - load.time)) for t in load.running_left]
    slots += [0.0] * max(0, load.num_slots - len(slots))
    heapq.heapify(slots)
    for w in (*load.waiting_left, *snap.pending):  # FIFO approximation of the queue
        heapq.heappush(slots, heapq.heappop(slots) + w)
    own = own_time(load, request)
    return Placement(snap.name, own, now + heapq.heappop(slots) + own)


def predict_finish(snap: EngineSnapshot, request: Request, now: float) -> float:
    """Predicted finish of `request` if sent to this instance now (queue + its own time at τ_max)."""
    return placement(snap, request, now).finish


class Router:
    """Chooses among instances by their snapshots; keeps no state of its own."""

    def choose(self, snapshots: Sequence[EngineSnapshot], request: Request, now: float,
               exclude: frozenset[str] = frozenset()) -> str:
        """Name of the instance to send `request` to."""
        return self.place(snapshots, request, now, exclude).instance

    def place(self, snapshots: Sequence[EngineSnapshot], request: Request, now: float,
              exclude: frozenset[str] = frozenset()) -> Placement:
        """The instance to send `request` to, with its own predicted seconds there."""
        healthy = [s for s in snapshots if s.healthy and s.name not in exclude]
        if not healthy:
            raise NoInstanceAvailable(no_instance_reason(snapshots))
        return min((placement(s, request, now) for s in healthy), key=lambda p: p.finish)


def no_instance_reason(snapshots: Sequence[EngineSnapshot]) -> str:
    """What a caller is told when no instance can take a request: each instance's state and fault."""
    down = "; ".join(f"{s.name}: " + ("unavailable" if s.healthy else s.state.name.lower())
                     + (f" ({s.error})" if s.error else "") for s in snapshots)
    return f"no instance is serving ({down or 'none configured'})"
