"""What the current layout realises: finished requests, whether they met their deadlines and how
long they took (pure Python; no JAX).

Each scheduler keeps its last finishes (`RecentOutcomes`) and publishes them in its load snapshot;
the autoscaler pools them over the instances (`realised`, `realised_latency`) and hands the
cluster controller the attainment and the mean latency the layout it runs actually reached, so the
controller can check its predictions for that layout against them (controller.py, "Feedback")."""
from __future__ import annotations

from collections import deque
from typing import Iterable


class RecentOutcomes:
    """(finish time, deadline met, latency s) of the last `window` requests finished here."""

    def __init__(self, window: int = 256) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self._finished: deque[tuple[float, bool, float]] = deque(maxlen=window)
        self._published: tuple[tuple[float, bool, float], ...] | None = ()

    def observe(self, now: float, met: bool, latency_s: float) -> None:
        self._finished.append((now, met, latency_s))
        self._published = None

    def published(self) -> tuple[tuple[float, bool, float], ...]:
        """An immutable copy, made again only after a finish (snapshots are published every step)."""
        if self._published is None:
            self._published = tuple(self._finished)
        return self._published


def realised(outcomes: Iterable[Iterable[tuple[float, bool, float]]], deadlines: Iterable[float], since: float,
             now: float) -> tuple[int, int]:
    """(met, counted) over the instances: requests finished at or after `since`, and the ones still
    in flight whose deadline has passed (certain misses that have not finished yet: under overload
    they are most of the misses, and counting only finishes would report them a queue wait late)."""
    met = counted = 0
    for per_instance in outcomes:
        for t, ok, _ in per_instance:
            if t >= since:
                counted += 1
                met += ok
    overdue = sum(1 for d in deadlines if d < now)
    return met, counted + overdue


def realised_latency(outcomes: Iterable[Iterable[tuple[float, bool, float]]], since: float) -> tuple[float, int]:
    """(mean latency s, count) over the instances of the requests that arrived at or after `since`
    and have finished: their whole stay was on the layout that has served since then (a request
    handed over at a switch carries its time on the old layout). (0.0, 0) when none."""
    total, n = 0.0, 0
    for per_instance in outcomes:
        for t, _, lat in per_instance:
            if t - lat >= since:
                total += lat
                n += 1
    return (total / n if n else 0.0), n
