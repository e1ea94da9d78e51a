"""What an instance publishes for other threads and the router to read: its state and an
immutable snapshot of its load (pure; the simulator's instances publish the same)."""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from dilaserve_jax.serving.policy.request import Request
from dilaserve_jax.serving.policy.scheduler import LoadSnapshot


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
