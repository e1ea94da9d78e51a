"""What one denoising step did to one slot: the one result type from the decoder up to the
scheduler (the real runner, the fake runner and the simulator's executor all return it)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SlotOutcome:
    """positions are answer-relative (0 = first answer token); tokens are what was committed there.

    confidence_counts: the block's masked positions (before this step's commits) per confidence bin,
    bins uniform over [0, 1]; empty when the runner does not report it.
    answer: when `request_finished`, the committed answer up to (excluding) its first EOS; else None.
    """

    slot: int
    positions: tuple[int, ...]
    tokens: tuple[int, ...]
    n_committed: int
    max_confidence: float
    block_finished: bool
    request_finished: bool
    confidence_counts: tuple[int, ...] = ()
    answer: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.request_finished and self.answer is None:
            raise ValueError(f"slot {self.slot}: a finishing outcome carries its answer")
