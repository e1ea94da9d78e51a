"""What an instance publishes for other threads and the router to read: its state, an immutable
snapshot of its load, and the estimator and request views inside it (pure; the simulator's
instances publish the same)."""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from enum import IntEnum

from dilaserve_jax.core.kinds import StepKind
from dilaserve_jax.serving.policy.latency import LatencyModel
from dilaserve_jax.serving.policy.quality import QualitySnapshot
from dilaserve_jax.serving.policy.request import Request, steps_left


@dataclass(frozen=True, slots=True)
class RequestEstimator:
    """A request's own time on one instance, from the instance's latency model, its online
    latency correction and its τ -> tokens/step estimate as they stood when published. Immutable,
    so any thread (a router) can use it while the instance's loop moves on."""

    latency: LatencyModel
    tp: int
    refresh_scale: float
    reuse_scale: float
    taus: tuple[float, ...]  # ascending
    rates: tuple[float, ...]  # tokens per step at each τ (non-increasing in τ)
    last_block_fill: float = 1.0  # mean share of the last block decoded before answers end (answer_fill.py)
    fill_count: int = 0  # finished requests that estimate is over

    def tokens_per_step(self, tau: float) -> float:
        i = bisect.bisect_left(self.taus, tau)
        if i == 0:
            return self.rates[0]
        if i == len(self.taus):
            return self.rates[-1]
        t0, t1, r0, r1 = self.taus[i - 1], self.taus[i], self.rates[i - 1], self.rates[i]
        return r0 + (r1 - r0) * (tau - t0) / (t1 - t0)

    def own_time(self, req: Request, batch: int, tau: float | None = None) -> float:
        """Seconds to finish `req` at τ (default its τ_max) among `batch` concurrent requests (each
        round one batch, or its cheapest split, as the instance's scheduler runs it)."""
        n_ref, n_reu = steps_left(req, self.tokens_per_step(req.tau_max if tau is None else tau))
        lat, canvas, block = self.latency, req.canvas_length, req.block_length
        return (n_ref * lat.round_seconds(StepKind.REFRESH, batch, canvas, block, self.tp) * self.refresh_scale
                + n_reu * lat.round_seconds(StepKind.REUSE, batch, canvas, block, self.tp) * self.reuse_scale)


@dataclass(frozen=True, slots=True)
class RequestView:
    """An immutable copy of what a controller needs of a request elsewhere: to estimate its time on
    another instance (where its next step is a refresh) and whether it would meet its deadline."""

    id: str
    deadline: float
    canvas_length: int
    block_length: int
    blocks_left: int
    masked_in_block: int
    tau_min: float
    tau_max: float
    running: bool
    moves: int
    needs_refresh: bool = True

    @classmethod
    def of(cls, r: Request) -> "RequestView":
        return cls(r.id, r.deadline, r.canvas_length, r.block_length, r.blocks_left, r.masked_in_block, r.tau_min,
                   r.tau_max, r.slot is not None, r.moves)


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """What a router needs to predict a new request's finish on this instance (immutable)."""

    time: float
    num_slots: int
    tp: int
    running_left: tuple[float, ...]  # predicted seconds to finish, running requests
    waiting_left: tuple[float, ...]  # predicted seconds of work, queued requests
    estimator: RequestEstimator | None = None
    deadlines: tuple[float, ...] = ()  # of every request here, running and queued
    at_risk: tuple[RequestView, ...] = ()  # requests that cannot meet their deadline here even at τ_min
    quality: QualitySnapshot | None = None  # accuracy-loss budget accounting
    # (finish time, deadline met, latency s) of the last finishes (outcomes.py)
    outcomes: tuple[tuple[float, bool, float], ...] = ()


class EngineState(IntEnum):
    CREATED = 0  # loop not started (step_once may still be driven by hand)
    RUNNING = 1
    STOPPED = 2
    FAILED = 3


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """What other threads may read about an engine (published by its loop; immutable)."""

    name: str
    state: EngineState
    load: LoadSnapshot
    pending: tuple[float, ...]  # predicted seconds of work submitted, not yet seen by the scheduler
    steps: int
    error: str | None

    @property
    def healthy(self) -> bool:
        return self.state in (EngineState.CREATED, EngineState.RUNNING)


def own_time(load: LoadSnapshot, request: Request) -> float:
    """The request's own predicted seconds on an instance, at τ_max, at the batch the instance's
    published load implies (pure: reads only the immutable snapshot)."""
    if load.estimator is None:
        return 0.0
    batch = max(1, min(load.num_slots, len(load.running_left) + len(load.waiting_left) + 1))
    return load.estimator.own_time(request, batch)
