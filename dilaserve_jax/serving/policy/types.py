"""The contract between the scheduler/engine and a runner (the decoding state of one instance).

Pure Python: the real runner (jitted steps) and the fake runner both implement `Runner`; the
scheduler only produces `StepPlan`s, so it never touches a runner (the simulator reuses it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

from dilaserve_jax.core.kinds import StepKind
from dilaserve_jax.core.outcome import SlotOutcome


@runtime_checkable
class Runner(Protocol):
    num_slots: int
    tp_degree: int

    def admit(self, slot: int, prompt_tokens: Sequence[int], answer_length: int, block_length: int, *,
              temperature: float = 0.0, seed: int = 0, committed: Sequence[int | None] | None = None,
              steps_done: int = 0) -> None:
        """Place a canvas in `slot`; that slot's next step must be REFRESH.

        A request resuming on this instance (migration, failure) passes `committed`, its answer
        tokens by position (None = still masked; blocks before the first masked one are complete),
        and `steps_done`, the steps it took elsewhere (sampling keys continue from there)."""

    def release(self, slot: int) -> None:
        """Forget the slot's request; the slot may be admitted into again."""

    def step(self, kind: StepKind, slots: Sequence[int], taus: Sequence[float],
             blocks: Sequence[int] | None = None) -> list[SlotOutcome]:
        """One batched step of `kind` over `slots`, with a τ and the current block (answer-relative
        block index) per slot, as the scheduler's plan says: the request owns its block and whether
        its next step is a refresh, and the runner follows (the engine always passes `blocks`;
        without them a runner keeps track itself, for offline use and tests). One outcome per slot,
        same order; a finishing slot's outcome carries its answer."""


@dataclass(frozen=True, slots=True)
class Admission:
    slot: int
    request_id: str
    prompt_tokens: tuple[int, ...]
    answer_length: int
    block_length: int
    temperature: float = 0.0
    seed: int = 0
    committed: tuple[int | None, ...] | None = None  # a resuming request's canvas (see Runner.admit)
    steps_done: int = 0


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One engine iteration: release slots, admit requests, then (if `slots`) run one step of
    `kind` over `slots`, each with its τ and its request's current block (`blocks`).

    Releases come first so a freed slot can be admitted into in the same plan.
    """

    time: float
    kind: StepKind | None
    slots: tuple[int, ...] = ()
    request_ids: tuple[str, ...] = ()
    taus: tuple[float, ...] = ()
    admits: tuple[Admission, ...] = ()
    releases: tuple[int, ...] = ()
    blocks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not (len(self.slots) == len(self.request_ids) == len(self.taus) == len(self.blocks)):
            raise ValueError("slots, request_ids, taus and blocks must have the same length")
        if self.slots and self.kind is None:
            raise ValueError("a plan with slots needs a step kind")
        if len(set(self.slots)) != len(self.slots):
            raise ValueError(f"duplicate slots in plan: {self.slots}")
        if any(not (0.0 < t <= 1.0) for t in self.taus):
            raise ValueError(f"τ must be in (0, 1], got {self.taus}")

    @property
    def has_step(self) -> bool:
        return bool(self.slots)
