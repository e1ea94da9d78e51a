"""A request and its state machine (pure Python; the simulator reuses it unchanged).

States:
  WAITING            queued, no slot yet.
  RUNNING            holds a runner slot and is being denoised.
  MIGRATING          between instances at a step boundary (migration, failure, reconfiguration):
                     it holds no slot, carries its committed canvas, and its next step is a refresh.
  FINISHED_OK        every answer token (up to EOS) committed; may still have missed its deadline
                     (see `deadline_met`).
  FINISHED_ABORTED   cancelled by the caller.
  FINISHED_REJECTED  refused by admission control (`reject_reason` says why).
  FINISHED_DEADLINE  dropped because its deadline passed before it finished (only when the
                     scheduler is configured to drop late requests, e.g. the client has gone).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Sequence

from dilaserve_jax.core.kinds import StepKind


class RequestState(IntEnum):
    WAITING = 0
    RUNNING = 1
    MIGRATING = 2
    FINISHED_OK = 3
    FINISHED_ABORTED = 4
    FINISHED_REJECTED = 5
    FINISHED_DEADLINE = 6

    @property
    def finished(self) -> bool:
        return self >= RequestState.FINISHED_OK


_S = RequestState
_LEGAL: dict[RequestState, frozenset[RequestState]] = {
    _S.WAITING: frozenset({_S.RUNNING, _S.FINISHED_ABORTED, _S.FINISHED_REJECTED, _S.FINISHED_DEADLINE}),
    # (a WAITING request that moves stays WAITING: it has nothing but its place in a queue)
    # (RUNNING -> WAITING: preempted, its slot given to a request that can still meet its deadline)
    _S.RUNNING: frozenset({_S.WAITING, _S.MIGRATING, _S.FINISHED_OK, _S.FINISHED_ABORTED, _S.FINISHED_DEADLINE}),
    _S.MIGRATING: frozenset({_S.RUNNING, _S.FINISHED_ABORTED, _S.FINISHED_DEADLINE}),
    _S.FINISHED_OK: frozenset(),
    _S.FINISHED_ABORTED: frozenset(),
    _S.FINISHED_REJECTED: frozenset(),
    _S.FINISHED_DEADLINE: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class StepRecord:
    kind: StepKind
    tau: float
    n_committed: int
    time: float  # when the step's result was applied
    duration: float  # plan-to-result wall time of the batched step


@dataclass(slots=True, eq=False)
class Request:
    """One generation request. `deadline` is absolute (same clock as `arrival`)."""

    id: str
    prompt_tokens: tuple[int, ...]
    answer_length: int
    block_length: int
    arrival: float
    deadline: float
    tau_min: float = 0.5
    tau_max: float = 1.0
    temperature: float = 0.0  # 0: greedy proposals
    seed: int = 0  # sampling seed when temperature > 0
    max_accuracy_drop: float | None = None  # own bound on its predicted loss (points); None: the server's budget
    strict_admission: bool | None = None  # refuse it if it cannot meet its deadline; None: the server's rule
    # --- mutable run-time record ---
    state: RequestState = RequestState.WAITING
    slot: int | None = None
    start_time: float | None = None
    finish_time: float | None = None
    committed: int = 0  # answer tokens committed so far
    block_index: int = 0  # current block
    block_committed: int = 0  # committed in the current block
    needs_refresh: bool = True  # next step kind is REFRESH (new, migrated, or a block just finished)
    at_risk: bool = False  # cannot meet its deadline even at tau_min; runs on spare capacity
    steps_skipped: float = 0.0  # consecutive schedule rounds it was eligible but not run, in fair shares (anti-starvation)
    reject_reason: str | None = None
    output_tokens: list[int] | None = None
    steps: list[StepRecord] = field(default_factory=list)
    answer: list[int | None] = field(default_factory=list)  # committed answer tokens by position
    moves: int = 0  # times it changed instance (migration, failure, reconfiguration)
    preemptions: int = 0  # times it gave its slot back to a request still in time (dilaserve, at risk)
    evidence: tuple[int, ...] = ()  # first step's masked positions per confidence bin (risk evidence)
    predicted_loss: float = 0.0  # accuracy points its τ trajectory is predicted to have cost

    def __post_init__(self) -> None:
        self.prompt_tokens = tuple(map(int, self.prompt_tokens))
        if not self.id:
            raise ValueError("request id must be non-empty")
        if self.answer_length <= 0 or self.block_length <= 0:
            raise ValueError("answer_length and block_length must be positive")
        if self.answer_length % self.block_length:
            raise ValueError(f"answer_length {self.answer_length} must be a multiple of block_length {self.block_length}")
        if not (0.0 < self.tau_min <= self.tau_max <= 1.0):
            raise ValueError(f"need 0 < tau_min <= tau_max <= 1, got {self.tau_min}, {self.tau_max}")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.deadline < self.arrival:
            raise ValueError("deadline precedes arrival")
        if not self.answer:
            self.answer = [None] * self.answer_length
        if self.max_accuracy_drop is not None and not (0 <= self.max_accuracy_drop < math.inf):
            raise ValueError(f"max_accuracy_drop must be a finite number of points >= 0, got {self.max_accuracy_drop}")

    # --- state machine ---
    def transition(self, new: RequestState, now: float) -> None:
        if new not in _LEGAL[self.state]:
            raise IllegalTransition(f"request {self.id}: {self.state.name} -> {new.name} is not allowed")
        if new == RequestState.RUNNING and self.start_time is None:
            self.start_time = now
        if new == RequestState.MIGRATING:
            self.needs_refresh = True  # KV cache is rebuilt on the destination
        if new.finished:
            self.finish_time = now
        self.state = new

    @property
    def finished(self) -> bool:
        return self.state.finished

    @property
    def deadline_met(self) -> bool | None:
        """None while unfinished; True only for FINISHED_OK on time."""
        if not self.finished:
            return None
        return self.state == RequestState.FINISHED_OK and self.finish_time <= self.deadline

    # --- progress ---
    def record_step(self, kind: StepKind, tau: float, n_committed: int, block_finished: bool,
                    now: float, duration: float, positions: Sequence[int] = (), tokens: Sequence[int] = ()) -> None:
        """Apply one step's result; `positions` (answer-relative) and `tokens` are what it committed,
        kept on the host so the request can move to another instance with its canvas."""
        if self.state != RequestState.RUNNING:
            raise IllegalTransition(f"request {self.id} stepped while {self.state.name}")
        self.steps.append(StepRecord(kind, tau, n_committed, now, duration))
        for p, t in zip(positions, tokens):
            if 0 <= p < self.answer_length:
                self.answer[p] = int(t)
        self.committed = min(self.answer_length, self.committed + n_committed)
        self.block_committed += n_committed
        if block_finished or self.block_committed >= self.block_length:
            self.block_index += 1
            self.block_committed = 0
            self.needs_refresh = True
        else:
            self.needs_refresh = False

    def preempt(self, now: float) -> None:
        """Give the slot back at a step boundary and wait again: RUNNING -> WAITING. The committed
        canvas is kept (it is admitted again with it, like a moved request); its next step is a refresh."""
        self.transition(RequestState.WAITING, now)
        self.slot = None
        self.needs_refresh = True
        self.preemptions += 1

    def detach(self, now: float) -> None:
        """Leave the instance at a step boundary: RUNNING -> MIGRATING (WAITING stays WAITING).
        The destination admits it with its committed canvas; its next step is a refresh."""
        if self.state == RequestState.RUNNING:
            self.transition(RequestState.MIGRATING, now)
        elif self.state not in (RequestState.WAITING, RequestState.MIGRATING):
            raise IllegalTransition(f"request {self.id} cannot move while {self.state.name}")
        self.slot = None
        self.needs_refresh = True
        self.at_risk = False
        self.steps_skipped = 0
        self.moves += 1

    @property
    def committed_answer(self) -> tuple[int | None, ...] | None:
        """The committed canvas to re-admit with (None when nothing is committed yet)."""
        return tuple(self.answer) if self.committed else None

    @property
    def next_kind(self) -> StepKind:
        return StepKind.REFRESH if self.needs_refresh else StepKind.REUSE

    @property
    def canvas_length(self) -> int:
        return len(self.prompt_tokens) + self.answer_length

    @property
    def num_blocks(self) -> int:
        return self.answer_length // self.block_length

    @property
    def masked_left(self) -> int:
        return self.answer_length - self.committed

    # (the planner reads these hundreds of times a round: plain comparisons, not max(), which costs
    # several times more in CPython)
    @property
    def blocks_left(self) -> int:
        """Blocks not yet finished, counting the current one."""
        n = self.answer_length // self.block_length - self.block_index
        return n if n > 0 else 0

    @property
    def masked_in_block(self) -> int:
        return self.block_length - self.block_committed if self.answer_length // self.block_length > self.block_index else 0

    def mean_tau(self) -> float | None:
        return sum(s.tau for s in self.steps) / len(self.steps) if self.steps else None

    def summary(self) -> dict:
        return {
            "id": self.id, "state": self.state.name, "arrival": self.arrival, "deadline": self.deadline,
            "start": self.start_time, "finish": self.finish_time, "deadline_met": self.deadline_met,
            "steps": len(self.steps), "mean_tau": self.mean_tau(), "reject_reason": self.reject_reason,
            "taus": [s.tau for s in self.steps], "predicted_loss": self.predicted_loss,
        }


def steps_left(req: Request, tokens_per_step: float) -> tuple[int, int]:
    """(refresh steps, reuse steps) to finish at `tokens_per_step` (>= 1) committed per step."""
    blocks = req.blocks_left  # (a `RequestView` has these too)
    if blocks == 0:
        return 0, 0
    tps = tokens_per_step if tokens_per_step > 1.0 else 1.0
    first = math.ceil(req.masked_in_block / tps)
    per_block = math.ceil(req.block_length / tps)
    first, per_block, full = first if first > 1 else 1, per_block if per_block > 1 else 1, blocks - 1
    n_refresh = full + 1 if req.needs_refresh else full
    return n_refresh, first + full * per_block - n_refresh


def make_request(id: str, prompt_tokens: Sequence[int], answer_length: int, block_length: int,
                 arrival: float, slo: float, **kw) -> Request:
    """Convenience: deadline given relative to arrival."""
    if not math.isfinite(slo) or slo <= 0:
        raise ValueError(f"slo must be positive, got {slo}")
    return Request(id, tuple(prompt_tokens), answer_length, block_length, arrival, arrival + slo, **kw)
