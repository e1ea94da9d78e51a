"""What the modelled instances' steps were: per TP degree and step kind, the steps run, the
requests they carried and the seconds they took.

The simulator's report prints it beside the SLO figures, because the controller's capacity model
assumes full batches at capacity and these counts show what the scheduler really ran: under a
lasting overload the overload rules keep late requests out of most steps (docs/simulation.md,
"The capacity an overloaded instance drains at"). Step seconds per finished request is the work a
request costs an instance: with every instance of a fixed layout busy, instances over it is the
layout's throughput.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dilaserve_jax.core.kinds import StepKind


@dataclass
class KindCounts:
    steps: int = 0
    requests: int = 0  # request-steps: the batch sizes summed
    seconds: float = 0.0

    @property
    def mean_batch(self) -> float:
        return self.requests / self.steps if self.steps else 0.0


@dataclass
class StepStats:
    """Accumulates every modelled runner's steps (a runner calls `record` once per step)."""

    counts: dict[tuple[int, StepKind], KindCounts] = field(default_factory=dict)

    def record(self, tp: int, kind: StepKind, batch: int, seconds: float) -> None:
        c = self.counts.setdefault((tp, kind), KindCounts())
        c.steps += 1
        c.requests += batch
        c.seconds += seconds

    def busy_s(self, tp: int | None = None) -> float:
        return sum(c.seconds for (t, _), c in self.counts.items() if tp is None or t == tp)

    def to_json(self, finished: int) -> dict:
        """{"by_tp": {tp: {kind: {steps, mean_batch, seconds}}}, "step_s_per_finished": s or None}."""
        by_tp: dict[str, dict] = {}
        for (tp, kind), c in sorted(self.counts.items()):  # TP, then refresh before reuse
            by_tp.setdefault(str(tp), {})[kind.name.lower()] = {
                "steps": c.steps, "mean_batch": round(c.mean_batch, 3), "seconds": round(c.seconds, 3)}
        return {"by_tp": by_tp, "step_s_per_finished": self.busy_s() / finished if finished else None}

    def describe(self, finished: int) -> str:
        """One line for the report, e.g. "steps: TP 2 254 s busy (refresh 4,749 steps, mean batch
        1.67; reuse 12,464, mean batch 1.90); 0.0473 step-s per finished request"."""
        if not self.counts:
            return "steps: none run"
        parts = []
        for tp in sorted({t for t, _ in self.counts}):
            kinds = [f"{kind.name.lower()} {c.steps:,} steps, mean batch {c.mean_batch:.2f}"
                     for kind in StepKind if (c := self.counts.get((tp, kind))) is not None]
            parts.append(f"TP {tp} {self.busy_s(tp):.0f} s busy ({'; '.join(kinds)})")
        per = f"; {self.busy_s() / finished:.4f} step-s per finished request" if finished else ""
        return "steps: " + ", ".join(parts) + per
