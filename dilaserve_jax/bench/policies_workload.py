"""Arrivals and SLOs of the policies benchmark (pure Python + numpy).

Arrivals: Poisson at the rate (the default), or windows of a trace CSV (`--trace`: columns TIMESTAMP,
ContextTokens, GeneratedTokens, e.g. the Azure 2023 code trace). A trace's rows with fewer than
`--trace-min-generated` generated tokens are dropped first (what is left keeps its own times, so its
bursts too). A window at rate R is `R x --duration` consecutive rows from a seeded start, its time
axis scaled so that they fill `--duration` seconds: the offered load over the window is exactly R
and the bursts inside it are the trace's.

Each trace row becomes a pool prompt by its generated tokens, with the rule every replay of a trace
on the tiny model uses (`sim.workload.TinyShapes.draw`, shared with the simulator and
`bench.serving`): at most 12 generated tokens, a 12-token task (sort, repeat); more, a 96-token task
(upper, altcase); the task within the group and the problem within the task at random.

SLOs: `--slo-range LO HI` gives uniform(LO, HI) x the prompt's own idle latency at the static τ;
`--slo-factor F` gives F x the median idle latency of the prompt's task (what a client that knows
the task, not the prompt, would set).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from dilaserve_jax.sim.workload import TinyShapes, load_trace


class PoolShapes(TinyShapes):
    """The benchmark's pool as the simulator's tiny shapes: `draw(rng, generated)` (inherited) returns
    the index of a pool prompt. The pool is the benchmark's own (held-out problems past the eval rows'
    sample), so it is set here rather than drawn by `TinyShapes.__init__`."""

    def __init__(self, tasks: Sequence[str]) -> None:  # tasks[i]: the task of pool item i
        self.pool: dict[str, list[int]] = {}
        for i, task in enumerate(tasks):
            self.pool.setdefault(task, []).append(i)


class TraceRows:
    """The rows of a trace CSV that ask for at least `min_generated` tokens, in time order."""

    def __init__(self, path: str, min_generated: int = 0) -> None:
        trace = load_trace(path)
        keep = trace.generated >= min_generated
        if keep.sum() < 2:
            raise ValueError(f"{path}: {int(keep.sum())} rows with at least {min_generated} generated tokens; need 2")
        self.source, self.min_generated, self.rows_in_file = trace.source, min_generated, len(trace)
        self.times, self.generated = trace.times[keep], trace.generated[keep]

    def __len__(self) -> int:
        return len(self.times)

    def window(self, n: int, duration: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """`n` consecutive rows from a random start: (arrival offsets filling [0, duration), generated tokens)."""
        if n + 1 > len(self):
            raise ValueError(f"{self.source}: a window of {n} arrivals needs {n + 1} rows, the trace has {len(self)} "
                             f"with at least {self.min_generated} generated tokens (lower --duration or the rate)")
        start = int(rng.integers(len(self) - n))
        t = self.times[start:start + n + 1] - self.times[start]
        span = float(t[-1])  # up to the next row: n gaps, so the mean rate is n / duration
        scale = duration / span if span > 0 else 0.0
        return t[:-1] * scale, self.generated[start:start + n]

    def describe(self) -> str:
        g = self.generated
        return (f"{self.source}: {len(self)} of {self.rows_in_file} rows (generated tokens >= {self.min_generated}; "
                f"median {np.median(g):g}, p90 {np.percentile(g, 90):g}), "
                f"{len(self) / max(self.times[-1], 1e-9):.2f} req/s as recorded")


class Workload:
    """What arrives at a rate: (arrival offset, pool index, SLO) lists, and the mix capacity is measured on."""

    def __init__(self, tasks: Sequence[str], *, duration: float, slo_range: tuple[float, float],
                 slo_factor: float | None = None, trace: str | None = None, trace_min_generated: int = 0,
                 seed: int = 0) -> None:
        self.tasks, self.duration, self.slo_range, self.slo_factor, self.seed = (
            list(tasks), duration, slo_range, slo_factor, seed)
        self.shapes = PoolShapes(tasks)
        self.rows = TraceRows(trace, trace_min_generated) if trace else None

    def slo_basis(self, idle: Sequence[float]) -> list[float]:
        """Per pool item, the latency its SLO is a multiple of: its own idle latency, or its task's median."""
        if self.slo_factor is None:
            return list(idle)
        median = {task: float(np.median([idle[i] for i in items])) for task, items in self.shapes.pool.items()}
        return [median[task] for task in self.tasks]

    def trace(self, rate: float, idle: Sequence[float], seed: int) -> list[tuple[float, int, float]]:
        rng = np.random.default_rng([self.seed, seed])
        basis = self.slo_basis(idle)
        if self.rows is None:  # Poisson (the draws in this order keep earlier runs' traces)
            out, t = [], float(rng.exponential(1 / rate))
            while t < self.duration:
                i = int(rng.integers(len(self.tasks)))
                out.append((t, i, self._slo_multiple(rng) * basis[i]))
                t += float(rng.exponential(1 / rate))
            return out
        times, generated = self.rows.window(max(1, round(rate * self.duration)), self.duration, rng)
        items = [self.shapes.draw(rng, int(g)) for g in generated]
        return [(float(t), i, self._slo_multiple(rng) * basis[i]) for t, i in zip(times, items)]

    def _slo_multiple(self, rng: np.random.Generator) -> float:
        return self.slo_factor if self.slo_factor is not None else float(rng.uniform(*self.slo_range))

    def capacity_items(self, at_least: int) -> list[int]:
        """Pool indices, at least `at_least`, in the proportions the workload draws them: the whole pool
        over and over for Poisson arrivals; the trace's rows, mapped, for a trace."""
        n = len(self.tasks)
        copies = -(-at_least // n)
        if self.rows is None:
            return [i for _ in range(copies) for i in range(n)]
        rng = np.random.default_rng([self.seed, 999_983])
        generated = self.rows.generated[:copies * n] if len(self.rows) >= copies * n else \
            rng.choice(self.rows.generated, copies * n)
        return [self.shapes.draw(rng, int(g)) for g in generated]

    def describe(self) -> str:
        arrivals = "Poisson" if self.rows is None else f"trace windows of {self.rows.describe()}"
        slo = (f"{self.slo_factor:g} x the task's median idle latency" if self.slo_factor is not None
               else f"uniform({self.slo_range[0]:g}, {self.slo_range[1]:g}) x the prompt's idle latency")
        return f"arrivals: {arrivals}; SLO {slo}"
