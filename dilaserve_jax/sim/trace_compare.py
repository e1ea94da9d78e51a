"""Two iteration traces of the same arrivals, side by side: the first divergence and where the time went.

A trace is a list of `IterationRecord`s (`serving/cluster/iteration_trace.py`): one from a real
engine, one from the simulator. `normalized` puts both in one frame (request ids by their index in
the arrival order, times from the run's start). `first_divergence` walks both, iteration by
iteration, and reports the first one whose decisions (arrivals, admissions, batch, kind, τ) or
step times differ. The summaries say where the two differ beyond that point: time accounting
(steps, host time, idle), host time per iteration by queue depth, the wait from arrival to first
step, and the step time per shape.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from dilaserve_jax.serving.cluster.iteration_trace import IterationRecord

QUEUE_BINS = ((0, 1), (1, 8), (8, 32), (32, 128), (128, 1 << 30))
FIELDS = ("arrivals", "admits", "releases", "kind", "batch", "taus")


def _index(rid: str) -> str:
    m = re.search(r"(\d+)$", rid)
    return m.group(1) if m else rid


def normalized(records: Sequence[IterationRecord], start: float = 0.0) -> list[IterationRecord]:
    """Request ids as their arrival index ("q12", "r12" -> "12"), engine times from `start`."""
    def t(x):
        return None if x is None else x - start
    return [dataclasses.replace(r, time=r.time - start, t0=t(r.t0), t1=t(r.t1),
                                arrivals=tuple((_index(i), a - start) for i, a in r.arrivals),
                                admits=tuple(_index(i) for i in r.admits), batch=tuple(_index(i) for i in r.batch))
            for r in records]


@dataclass(frozen=True, slots=True)
class Divergence:
    index: int
    what: str  # the first field that differs, or "time", or "length"
    real: object
    sim: object
    real_time: float | None  # each side's clock at that iteration
    sim_time: float | None
    lag_s: float  # real clock minus simulated clock at the last iteration both ended alike

    def __str__(self) -> str:
        at = "" if self.real_time is None or self.sim_time is None else \
            f" (real clock {self.real_time:.6f} s, simulated {self.sim_time:.6f} s)"
        return (f"first divergence at iteration {self.index}{at}: {self.what} real {self.real!r}, simulated "
                f"{self.sim!r}; real minus simulated clock at the previous step's end {1e3 * self.lag_s:+.3f} ms")


def first_divergence(real: Sequence[IterationRecord], sim: Sequence[IterationRecord],
                     time_tol: float = 1e-9) -> Divergence | None:
    """The first iteration whose decisions differ, or whose step start or end differs by more than
    `time_tol` seconds; None when the traces are identical."""
    lag = 0.0
    for i, (a, b) in enumerate(zip(real, sim)):
        for f in FIELDS:
            va, vb = getattr(a, f), getattr(b, f)
            if f == "arrivals":
                va, vb = tuple(x for x, _ in va), tuple(x for x, _ in vb)
            if f == "taus":
                va, vb = tuple(round(x, 9) for x in va), tuple(round(x, 9) for x in vb)
            if va != vb:
                return Divergence(i, f, va, vb, a.time, b.time, lag)
        for f in ("time", "t0", "t1"):
            va, vb = getattr(a, f), getattr(b, f)
            if (va is None) != (vb is None) or (va is not None and abs(va - vb) > time_tol):
                return Divergence(i, f"time ({f})", va, vb, a.time, b.time, lag)
        if a.t1 is not None:
            lag = a.t1 - b.t1
    if len(real) != len(sim):
        i = min(len(real), len(sim))
        return Divergence(i, "length", len(real), len(sim), None, None, lag)
    return None


# --- where the time went -----------------------------------------------------------------------
def host_per_iteration(records: Sequence[IterationRecord], real: bool) -> list[tuple[int, int, float]]:
    """(batch, queue, host seconds) per step: measured on the real side (`host_time.host_samples`),
    the charged model on the simulated one."""
    if real:
        from dilaserve_jax.sim.host_time import host_samples

        return host_samples(records)
    return [(len(r.batch), r.waiting, r.modelled_host_s) for r in records if r.kind is not None]


def accounting(records: Sequence[IterationRecord], real: bool) -> dict:
    """Seconds of steps, host time around them, and what is left (idle) over the run's span."""
    steps = [r for r in records if r.kind is not None]
    host = sum(h for _, _, h in host_per_iteration(records, real))
    step_s = sum(r.t1 - r.t0 for r in steps) - (0.0 if real else host)
    span = max((r.t1 for r in steps), default=0.0) - (records[0].time if records else 0.0)
    return {"iterations": len(records), "steps": len(steps), "span_s": span, "step_s": step_s, "host_s": host,
            "idle_s": max(0.0, span - step_s - host),
            "mean_batch": float(np.mean([len(r.batch) for r in steps])) if steps else 0.0,
            "mean_waiting": float(np.mean([r.waiting for r in steps])) if steps else 0.0}


def host_by_queue(records: Sequence[IterationRecord], real: bool) -> dict[tuple[int, int], tuple[int, float, float]]:
    """Queue-depth bin -> (iterations, mean host ms, p90 host ms)."""
    rows = np.array(host_per_iteration(records, real), dtype=float).reshape(-1, 3)
    out = {}
    for lo, hi in QUEUE_BINS:
        sel = rows[(rows[:, 1] >= lo) & (rows[:, 1] < hi), 2]
        if len(sel):
            out[(lo, hi)] = (len(sel), 1e3 * float(sel.mean()), 1e3 * float(np.percentile(sel, 90)))
    return out


def first_step_waits(records: Sequence[IterationRecord]) -> dict[str, float]:
    """Per request: its first step's start minus its arrival (the queueing and admission delay)."""
    arrival = {rid: a for r in records for rid, a in r.arrivals}
    out: dict[str, float] = {}
    for r in records:
        for rid in r.batch:
            if rid not in out and rid in arrival and r.t0 is not None:
                out[rid] = r.t0 - arrival[rid]
    return out


def admission_gaps(records: Sequence[IterationRecord]) -> list[float]:
    """Arrival to the iteration that took the request in, for requests that arrived while the
    engine was idle (how long an idle loop takes to notice work)."""
    return [r.time - a for r in records if r.after_idle for _, a in r.arrivals]


def step_error_by_shape(records: Sequence[IterationRecord], modelled: Callable[[IterationRecord], float],
                        real: bool) -> dict[tuple[int, int], tuple[int, float, float]]:
    """(kind, batch size) -> (steps, mean step ms, mean over modelled): each step's duration (less
    the charged host time on the simulated side) against `modelled(record)`, the noise-free model."""
    groups: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for r in records:
        if r.kind is None:
            continue
        dur = r.t1 - r.t0 - (0.0 if real else r.modelled_host_s)
        groups.setdefault((r.kind, len(r.batch)), []).append((dur, modelled(r)))
    return {k: (len(v), 1e3 * float(np.mean([d for d, _ in v])), float(np.mean([d / m for d, m in v if m > 0])))
            for k, v in sorted(groups.items())}


def _stats(values: Sequence[float]) -> str:
    if not values:
        return "none"
    v = 1e3 * np.asarray(values)
    return f"mean {v.mean():.2f} ms, p50 {np.percentile(v, 50):.2f}, p90 {np.percentile(v, 90):.2f} (n={len(v)})"


def format_comparison(real: Sequence[IterationRecord], sim: Sequence[IterationRecord],
                      modelled: Callable[[IterationRecord], float]) -> str:
    """The report of `bench.trace_diff`: the first divergence, then each summary for both sides."""
    div = first_divergence(real, sim)
    lines = [str(div) if div else "the traces are identical"]
    if div is not None and div.what.startswith("time"):
        dec = first_divergence(real, sim, time_tol=float("inf"))
        lines.append("decisions: " + (str(dec) if dec else "identical throughout"))
    acc = accounting(real, True), accounting(sim, False)
    lines.append("time accounting      real            simulated")
    for k in ("iterations", "steps", "span_s", "step_s", "host_s", "idle_s", "mean_batch", "mean_waiting"):
        lines.append(f"  {k:<18}{acc[0][k]:>10.3f}{acc[1][k]:>16.3f}")
    lines.append("host time per step by queue depth: real (n, mean ms, p90 ms) | simulated")
    hq = host_by_queue(real, True), host_by_queue(sim, False)
    for b in QUEUE_BINS:
        a, s = hq[0].get(b), hq[1].get(b)
        if a or s:
            fmt = (lambda x: "-" if x is None else f"{x[0]:>5} {x[1]:>7.3f} {x[2]:>7.3f}")
            lines.append(f"  queue {b[0]:>3}-{'' if b[1] > 1e6 else b[1]:<4} {fmt(a)} | {fmt(s)}")
    waits = first_step_waits(real), first_step_waits(sim)
    lines.append(f"arrival to first step: real {_stats(list(waits[0].values()))}")
    lines.append(f"                  simulated {_stats(list(waits[1].values()))}")
    common = sorted(set(waits[0]) & set(waits[1]), key=int)
    if common:
        d = [waits[0][k] - waits[1][k] for k in common]
        lines.append(f"  real minus simulated, same request: {_stats(d)}")
    lines.append(f"arrival to pick-up by an idle loop: real {_stats(admission_gaps(real))}; "
                 f"simulated {_stats(admission_gaps(sim))}")
    lines.append("step time by (kind, batch): real (n, mean ms, over model) | simulated")
    se = step_error_by_shape(real, modelled, True), step_error_by_shape(sim, modelled, False)
    for k in sorted(set(se[0]) | set(se[1])):
        a, s = se[0].get(k), se[1].get(k)
        fmt = (lambda x: "-" if x is None else f"{x[0]:>5} {x[1]:>7.2f} {x[2]:>6.3f}")
        lines.append(f"  kind {k[0]} batch {k[1]:>2}  {fmt(a)} | {fmt(s)}")
    return "\n".join(lines)
