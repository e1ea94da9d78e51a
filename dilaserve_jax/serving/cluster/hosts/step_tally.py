"""Step metrics counted where the steps run: histogram buckets a host's worker fills and the
leader exports.

The one-process server observes every step into its Prometheus histograms on the engine thread
(`dilaserve_step_seconds` by kind, `dilaserve_tau` and `dilaserve_tokens_per_step` per request
step). A remote instance's steps run in its host's worker, so there a `StepTally` (an engine step
hook) counts the same observations into the same buckets, and the worker sends what it counted
since its last poll with that poll's reports: one small message per host and poll however many
steps ran, which keeps the leader's work per step at nothing. The leader adds each host's counts
into that host's running total, which the metrics endpoint exports with a `host` label
(frontend/metrics.py). Counts made after a worker's last poll are lost with it when it dies.
"""
from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field
from typing import Sequence

TAU_BUCKETS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0)
TOKEN_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass(slots=True)
class Buckets:
    """One histogram: counts per upper bound (the last one +Inf), their sum."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # not cumulative; len(bounds) + 1
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # le: a value on a bound counts there
        self.total += value

    def add(self, other: "Buckets") -> None:
        if other.bounds != self.bounds:
            raise ValueError("histograms with different buckets")
        self.counts = [a + b for a, b in zip(self.counts, other.counts)]
        self.total += other.total

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations at or below it), +Inf last, as Prometheus writes them."""
        out, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            running += n
            out.append((bound, running))
        return out


@dataclass(slots=True)
class StepCounts:
    """A host's step observations: step seconds by kind label, τ and tokens per request step."""

    seconds: dict[str, Buckets] = field(default_factory=dict)
    tau: Buckets = field(default_factory=lambda: Buckets(TAU_BUCKETS))
    tokens: Buckets = field(default_factory=lambda: Buckets(TOKEN_BUCKETS))

    @property
    def empty(self) -> bool:
        return not self.seconds

    def add(self, other: "StepCounts") -> None:
        for kind, buckets in other.seconds.items():
            self.seconds.setdefault(kind, Buckets(STEP_BUCKETS)).add(buckets)
        self.tau.add(other.tau)
        self.tokens.add(other.tokens)


class StepTally:
    """The engine step hook of a host's worker: counts every step of its engines (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = StepCounts()

    def __call__(self, name: str, plan, outcomes: Sequence, t0: float, t1: float) -> None:
        with self._lock:
            c = self._counts
            c.seconds.setdefault(plan.kind.label, Buckets(STEP_BUCKETS)).observe(t1 - t0)
            for tau, outcome in zip(plan.taus, outcomes):
                c.tau.observe(tau)
                c.tokens.observe(outcome.n_committed)

    def take(self) -> StepCounts | None:
        """What was counted since the last take (None: no step ran)."""
        with self._lock:
            if self._counts.empty:
                return None
            counts, self._counts = self._counts, StepCounts()
        return counts


class HostStepTotals:
    """The leader's running totals, by host (a host's later workers add to the same total)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_host: dict[str, StepCounts] = {}

    def add(self, host: str, counts: StepCounts) -> None:
        with self._lock:
            self._by_host.setdefault(host, StepCounts()).add(counts)

    def __call__(self) -> dict[str, StepCounts]:
        """A copy of every host's totals (the metrics endpoint reads it at scrape time)."""
        with self._lock:
            out = {}
            for host, c in self._by_host.items():
                copy = StepCounts()
                copy.add(c)
                out[host] = copy
            return out
