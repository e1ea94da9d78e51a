"""The values an engine exchanges with other threads: its state, snapshots, results, progress,
hand-offs and errors (all immutable or owned by one side at a time; see `engine.py`)."""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from dilaserve_jax.serving.policy.request import Request, RequestState
from dilaserve_jax.serving.policy.types import StepPlan
from dilaserve_jax.core.outcome import SlotOutcome
from dilaserve_jax.core.kinds import StepKind

if TYPE_CHECKING:
    from dilaserve_jax.serving.cluster.engine import Engine


class EngineUnavailable(RuntimeError):
    """The engine does not take work: stopped, or failed (`cause` says why)."""

    def __init__(self, message: str, cause: BaseException | None = None):
        super().__init__(message)
        self.cause = cause


class HungStep(RuntimeError):
    """A runner call outlived the watchdog's limit."""


@dataclass(frozen=True, slots=True)
class StepProgress:
    """One step's effect on one request (for streaming the canvas as it fills in)."""

    request_id: str
    kind: StepKind
    tau: float
    positions: tuple[int, ...]
    tokens: tuple[int, ...]
    committed: int  # answer tokens committed so far
    answer_length: int
    time: float
    instance: str = ""


@dataclass(frozen=True, slots=True)
class RequestResult:
    request_id: str
    state: RequestState
    tokens: tuple[int, ...]
    deadline_met: bool
    arrival: float
    start: float | None
    finish: float | None
    steps: int
    mean_tau: float | None
    reject_reason: str | None = None
    instance: str = ""  # the instance that finished it
    moves: int = 0
    taus: tuple[float, ...] = ()  # τ of every step, in order
    predicted_loss: float = 0.0  # accuracy points its τ trajectory is predicted to have cost

    @classmethod
    def of(cls, r: Request, instance: str = "") -> "RequestResult":
        return cls(r.id, r.state, tuple(r.output_tokens or ()), bool(r.deadline_met), r.arrival, r.start_time,
                   r.finish_time, len(r.steps), r.mean_tau(), r.reject_reason, instance, r.moves,
                   tuple(s.tau for s in r.steps), r.predicted_loss)


ProgressFn = Callable[[StepProgress], None]
StepHook = Callable[[str, StepPlan, Sequence[SlotOutcome], float, float], None]  # name, plan, outcomes, t0, t1


@dataclass(slots=True)
class Handoff:
    """An unfinished request leaving an instance, with the future and callback of its caller."""

    request: Request
    future: Future
    on_progress: ProgressFn | None
    speed_ratio: float | None = None


FailureFn = Callable[["Engine", list[Handoff], BaseException], None]


class RequestHandle:
    def __init__(self, request_id: str, future: Future, where: Callable[[], str], abort: Callable[[], Any]) -> None:
        self.request_id, self.future, self._where, self._abort = request_id, future, where, abort

    def result(self, timeout: float | None = None) -> RequestResult:
        return self.future.result(timeout)

    @property
    def instance(self) -> str:
        """Name of the instance serving this request now (it may move)."""
        return self._where()

    def done(self) -> bool:
        return self.future.done()

    def abort(self) -> None:
        self._abort()


def describe_error(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def resolve_future(fut: Future, value) -> None:
    """Set a result unless the future is done already (a caller may cancel it concurrently)."""
    if not fut.done():
        try:
            fut.set_result(value)
        except Exception:  # noqa: BLE001 - cancelled concurrently
            pass


def fail_future(fut: Future, err: BaseException) -> None:
    """Set an exception unless the future is done already."""
    if not fut.done():
        try:
            fut.set_exception(err)
        except Exception:  # noqa: BLE001 - cancelled concurrently
            pass
