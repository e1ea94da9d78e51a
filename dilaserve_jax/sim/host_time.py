"""Host time per engine iteration, fitted on a recorded run: what the simulator charges besides the step.

A real iteration's time beyond its step (`serving/cluster/iteration_trace.py`): the loop's own
phases (mailbox, schedule, the runner's admissions and releases, update, publish) and what its
driver does before the next iteration starts (submitting arrivals) when the engine was not idle.
`HostTimeModel.fit` bins the iterations by queue depth (0, 1, 2-3, 4-7, ...), regresses each bin's
host time on the step's batch size and keeps its residuals; `sample` draws the fitted value plus
a resampled residual of the same bin, so a simulated run reproduces the recorded run's mean and
spread at the same (batch, queue). Queues deeper than any recorded one use the deepest bin. Like the step profile, it is an input measured on the real side, never tuned.
"""
from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from dilaserve_jax.serving.cluster.iteration_trace import IterationRecord

# phases of a real iteration outside the runner's step (prepare: admissions and releases, which the
# modelled runner does for free)
OUTSIDE_STEP = ("mailbox", "schedule", "prepare", "update", "publish")


def host_samples(records: Sequence[IterationRecord]) -> list[tuple[int, int, float]]:
    """(batch, queue, host seconds) per iteration with a step: its phases outside the step, plus the
    driver's time before the next iteration where the engine did not go idle in between."""
    out = []
    for i, r in enumerate(records):
        if r.kind is None:
            continue
        host = sum(r.phases.get(p, 0.0) for p in OUTSIDE_STEP)
        nxt = records[i + 1] if i + 1 < len(records) else None
        if nxt is not None and not nxt.after_idle:
            host += max(0.0, nxt.start - r.end)
        out.append((len(r.batch), r.waiting, host))
    return out


MIN_BIN_SAMPLES = 30  # a queue-depth bin with fewer samples is merged into the one below


def queue_bin_edges(limit: int) -> list[int]:
    """Lower edges of the queue-depth bins: 0, 1, 2, 4, 8, ... up to `limit`."""
    edges, e = [0, 1], 2
    while e <= limit:
        edges.append(e)
        e *= 2
    return edges


@dataclass(frozen=True, slots=True)
class HostBin:
    queue_from: int  # this bin covers queue depths from here to the next bin's start
    intercept_s: float
    per_request_s: float  # per request in the step's batch
    residuals: tuple[float, ...]  # measured minus fitted, resampled by `HostTimeModel.sample`


@dataclass(frozen=True, slots=True)
class HostTimeModel:
    """Per queue-depth bin (log2 bins, each with at least `MIN_BIN_SAMPLES` iterations): host time
    linear in the batch size, plus that bin's resampled residuals. Deeper queues than the run
    measured use its deepest bin (no extrapolation: the planner's own work is bounded at depth)."""

    bins: tuple[HostBin, ...]
    source: str = ""

    def _bin(self, queue: int) -> HostBin:
        i = bisect.bisect_right([b.queue_from for b in self.bins], queue) - 1
        return self.bins[max(0, i)]

    def mean(self, batch: int, queue: int) -> float:
        b = self._bin(queue)
        return max(0.0, b.intercept_s + b.per_request_s * batch + (float(np.mean(b.residuals)) if b.residuals else 0.0))

    def sample(self, batch: int, queue: int, rng: np.random.Generator) -> float:
        b = self._bin(queue)
        base = b.intercept_s + b.per_request_s * batch
        if b.residuals:
            base += b.residuals[int(rng.integers(len(b.residuals)))]
        return max(0.0, base)

    @classmethod
    def fit(cls, samples: Iterable[tuple[int, int, float]], source: str = "") -> "HostTimeModel":
        rows = np.array(list(samples), dtype=float).reshape(-1, 3)
        if len(rows) == 0:
            raise ValueError("no iterations with a step to fit host time on")
        edges = queue_bin_edges(int(rows[:, 1].max()))
        groups: list[tuple[int, np.ndarray]] = []
        for lo, hi in zip(edges, edges[1:] + [1 << 62]):
            sel = rows[(rows[:, 1] >= lo) & (rows[:, 1] < hi)]
            if not len(sel):
                continue
            if groups and len(groups[-1][1]) < MIN_BIN_SAMPLES:  # too few below: merge upwards
                groups[-1] = (groups[-1][0], np.concatenate([groups[-1][1], sel]))
            else:
                groups.append((lo, sel))
        if len(groups) > 1 and len(groups[-1][1]) < MIN_BIN_SAMPLES:  # too few at the top: merge downwards
            last = groups.pop()
            groups[-1] = (groups[-1][0], np.concatenate([groups[-1][1], last[1]]))
        bins = []
        for lo, sel in groups:
            batch, y = sel[:, 0], sel[:, 2]
            if np.ptp(batch) > 0:
                slope, icpt = np.polyfit(batch, y, 1)
            else:
                slope, icpt = 0.0, float(y.mean())
            resid = tuple(float(v) for v in y - (icpt + slope * batch))
            bins.append(HostBin(lo, float(icpt), float(slope), resid))
        return cls(tuple(bins), source or f"fitted on {len(rows)} iterations")

    @classmethod
    def fit_records(cls, records: Sequence[IterationRecord], source: str = "") -> "HostTimeModel":
        return cls.fit(host_samples(records), source)

    def describe(self) -> str:
        parts = [f"queue {b.queue_from}+: {1e3 * b.intercept_s:.3f} ms + {1e3 * b.per_request_s:.3f} ms/request "
                 f"(n={len(b.residuals)})" for b in self.bins]
        return f"host time per iteration by queue depth: {'; '.join(parts)} ({self.source})"

    def to_json(self) -> dict:
        return {"bins": [{"queue_from": b.queue_from, "intercept_s": b.intercept_s, "per_request_s": b.per_request_s,
                          "residuals": list(b.residuals)} for b in self.bins], "source": self.source}

    @classmethod
    def from_json(cls, d: dict) -> "HostTimeModel":
        return cls(tuple(HostBin(int(b["queue_from"]), float(b["intercept_s"]), float(b["per_request_s"]),
                                 tuple(float(r) for r in b["residuals"])) for b in d["bins"]), d.get("source", ""))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: str | Path) -> "HostTimeModel":
        return cls.from_json(json.loads(Path(path).read_text()))
