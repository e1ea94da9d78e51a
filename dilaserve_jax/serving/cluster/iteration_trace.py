"""A record of every engine iteration: what it decided, on the engine's clock, and where its host time went.

`Engine.tracer` is `NO_TRACE` (does nothing) unless an `IterationTracer` is set before the loop
starts. The engine then calls, on its own thread: `arrived` for each request its mailbox adds,
`begin` at the start of an iteration, `lap(phase)` at the end of each phase, and `end` when the
iteration is done (`end(None, ...)`: it found nothing to do). Idle iterations are not recorded:
the next record says `after_idle` (the loop waited for work before it), and arrivals a full queue
refused go with it.

Phases, each timed on the host's wall clock (`time.perf_counter`), whatever the engine's clock:
  mailbox   applying submitted requests, aborts and calls;
  schedule  `Scheduler.schedule` (the threshold controller's plan included) and resolving finished ones;
  prepare   the runner's admissions and releases;
  step      the runner's step;
  update    `Scheduler.update`, progress callbacks and step hooks;
  publish   resolving finished requests and publishing the snapshot.
`host_s` is all but prepare and step: the loop's own work outside the runner. `start`/`end` are
the iteration's wall-clock bounds, so the time a driver spends between two iterations shows too.
The decisions (arrivals, admissions, batch, kind, τ) and `t0`/`t1` (the step's bounds on the
engine's clock) are what two runs on the same arrivals must agree on.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable

PHASES = ("mailbox", "schedule", "prepare", "step", "update", "publish")
HOST_PHASES = ("mailbox", "schedule", "update", "publish")


@dataclass(frozen=True, slots=True)
class IterationRecord:
    index: int
    time: float  # the engine's clock when it scheduled
    arrivals: tuple[tuple[str, float], ...]  # (request id, arrival time) added to the scheduler this iteration
    admits: tuple[str, ...]
    releases: int
    kind: int | None  # StepKind value; None: no step (admissions or releases only)
    batch: tuple[str, ...]
    taus: tuple[float, ...]
    t0: float | None  # the step's start and end on the engine's clock
    t1: float | None
    waiting: int  # queued after this iteration's admissions
    running: int
    phases: dict[str, float] = field(default_factory=dict)  # phase -> wall seconds (see module doc)
    start: float = 0.0  # wall clock at the iteration's start and end
    end: float = 0.0
    modelled_host_s: float = 0.0  # the simulator's charged host time (0 on a real engine)
    after_idle: bool = False  # the engine had been idle since the previous record

    @property
    def host_s(self) -> float:
        return sum(self.phases.get(p, 0.0) for p in HOST_PHASES)

    def decisions(self) -> tuple:
        """What two runs on the same arrivals must agree on (times rounded to 1 ns)."""
        rnd = (lambda t: None if t is None else round(t, 9))
        return (tuple((rid, round(a, 9)) for rid, a in self.arrivals), self.admits, self.releases, self.kind,
                self.batch, tuple(round(t, 9) for t in self.taus), rnd(self.time), rnd(self.t0), rnd(self.t1))

    def to_json(self) -> dict:
        out = asdict(self)
        out["arrivals"] = [list(a) for a in self.arrivals]
        return out

    @classmethod
    def from_json(cls, d: dict) -> "IterationRecord":
        return cls(**(d | {"arrivals": tuple((str(r), float(a)) for r, a in d["arrivals"]),
                           "admits": tuple(d["admits"]), "batch": tuple(d["batch"]), "taus": tuple(d["taus"])}))


class NullTracer:
    """The engine's default: records nothing."""

    def arrived(self, request_id: str, arrival: float) -> None:
        pass

    def begin(self) -> None:
        pass

    def lap(self, phase: str) -> None:
        pass

    def end(self, plan, scheduler, t0: float | None = None, t1: float | None = None) -> None:
        pass


NO_TRACE = NullTracer()


class IterationTracer(NullTracer):
    """Collects an `IterationRecord` per working iteration in `records`.

    `engine_clock`: the engine's clock (the record's `time`); `modelled_host`: returns the host
    time the simulator charged the iteration's step (a modelled runner's `last_host_s`)."""

    def __init__(self, engine_clock: Callable[[], float], modelled_host: Callable[[], float] | None = None,
                 wall: Callable[[], float] = time.perf_counter) -> None:
        self.engine_clock, self.modelled_host, self.wall = engine_clock, modelled_host, wall
        self.records: list[IterationRecord] = []
        self._arrivals: list[tuple[str, float]] = []
        self._phases: dict[str, float] = {}
        self._start = self._last = 0.0
        self._idle = False

    def arrived(self, request_id: str, arrival: float) -> None:
        self._arrivals.append((request_id, float(arrival)))

    def begin(self) -> None:
        self._start = self._last = self.wall()
        self._phases = {}

    def lap(self, phase: str) -> None:
        now = self.wall()
        self._phases[phase] = self._phases.get(phase, 0.0) + now - self._last
        self._last = now

    def end(self, plan, scheduler, t0: float | None = None, t1: float | None = None) -> None:
        if plan is None:
            self._idle = True
            return
        kind = None if plan.kind is None else int(plan.kind)
        host = self.modelled_host() if self.modelled_host is not None and plan.has_step else 0.0
        self.records.append(IterationRecord(
            len(self.records), plan.time, tuple(self._arrivals), tuple(a.request_id for a in plan.admits),
            len(plan.releases), kind, plan.request_ids, plan.taus, t0, t1, len(scheduler.waiting),
            len(scheduler.running), dict(self._phases), self._start, self.wall(), host, self._idle))
        self._arrivals, self._idle = [], False
