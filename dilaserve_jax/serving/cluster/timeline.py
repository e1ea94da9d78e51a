"""Step hook that records when every instance was inside a step (measures overlap across instances)."""
from __future__ import annotations

import threading
from typing import Sequence

from dilaserve_jax.serving.policy.types import StepPlan
from dilaserve_jax.core.outcome import SlotOutcome


class StepTimeline:
    """Step hook recording (instance, start, end) of every step; measures cross-instance overlap."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.intervals: dict[str, list[tuple[float, float]]] = {}

    def __call__(self, name: str, plan: StepPlan, outcomes: Sequence[SlotOutcome], t0: float, t1: float) -> None:
        with self._lock:
            self.intervals.setdefault(name, []).append((t0, t1))

    def busy(self, name: str) -> float:
        return sum(b - a for a, b in self.intervals.get(name, []))

    def overlap(self, a: str, b: str) -> float:
        """Seconds during which both instances were inside a step."""
        total, xs, ys = 0.0, sorted(self.intervals.get(a, [])), sorted(self.intervals.get(b, []))
        i = j = 0
        while i < len(xs) and j < len(ys):
            lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
            total += max(0.0, hi - lo)
            if xs[i][1] < ys[j][1]:
                i += 1
            else:
                j += 1
        return total
