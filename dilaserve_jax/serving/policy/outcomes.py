"""What the current layout realises: finished requests and whether they met their deadlines
(pure Python; no JAX).

Each scheduler keeps its last finishes (`RecentOutcomes`) and publishes them in its load snapshot;
the autoscaler pools them over the instances (`realised`) and hands the cluster controller the
attainment the layout it runs actually reached, so the controller can check its prediction for
that layout against it (controller.py, "Feedback")."""
from __future__ import annotations

from collections import deque
from typing import Iterable


class RecentOutcomes:
    """(finish time, deadline met) of the last `window` requests finished here."""

    def __init__(self, window: int = 256) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self._finished: deque[tuple[float, bool]] = deque(maxlen=window)
        self._published: tuple[tuple[float, bool], ...] | None = ()

    def observe(self, now: float, met: bool) -> None:
        self._finished.append((now, met))
        self._published = None

    def published(self) -> tuple[tuple[float, bool], ...]:
        """An immutable copy, made again only after a finish (snapshots are published every step)."""
        if self._published is None:
            self._published = tuple(self._finished)
        return self._published


def realised(outcomes: Iterable[Iterable[tuple[float, bool]]], deadlines: Iterable[float], since: float,
             now: float) -> tuple[int, int]:
    """(met, counted) over the instances: requests finished at or after `since`, and the ones still
    in flight whose deadline has passed (certain misses that have not finished yet: under overload
    they are most of the misses, and counting only finishes would report them a queue wait late)."""
    met = counted = 0
    for per_instance in outcomes:
        for t, ok in per_instance:
            if t >= since:
                counted += 1
                met += ok
    overdue = sum(1 for d in deadlines if d < now)
    return met, counted + overdue
