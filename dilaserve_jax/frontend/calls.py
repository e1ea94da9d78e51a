"""The generation path both front doors share (gRPC in service.py, HTTP in http/): refusal while
warming up or draining, validation and request ids, submission to the cluster, the canvas as it
fills in, cancellation, the outcome counters, and the in-flight count a drain waits for.

`Calls.accept` turns a `GenerateRequest` into a `GenerateSpec` (or raises `CallError`);
`Calls.run` submits it and yields `Submitted`, then (when streaming) one `Step` per denoising
step, then `Finished`. Closing the generator before `Finished` (the caller left, its task was
cancelled) aborts the request: its slot is freed at the next step and it counts as cancelled.
Each frontend maps `CallError.failure` to its own status codes.
"""
from __future__ import annotations

import asyncio
import enum
import logging
from dataclasses import dataclass

from dilaserve_jax.frontend.validation import GenerateSpec, InvalidRequest, validate
from dilaserve_jax.models.tokenizer import TokenizerMissing
from dilaserve_jax.serving.cluster.cluster import DuplicateRequest
from dilaserve_jax.serving.cluster.engine_types import EngineUnavailable, RequestResult, StepProgress
from dilaserve_jax.serving.policy.request import Request, RequestState
from dilaserve_jax.serving.policy.router import NoInstanceAvailable

log = logging.getLogger(__name__)
END_MARK = "\u00b7"  # canvas positions after the answer's end (EOS)
UNAVAILABLE_ERRORS = (EngineUnavailable, NoInstanceAvailable)
DRAINING = "server is draining; retry on another replica"


class Failure(enum.Enum):
    """Why a call did not get its answer, in terms both frontends map to their status codes."""

    INVALID = "invalid"            # the request itself (CallError.field names the field)
    NO_TOKENIZER = "no_tokenizer"  # text sent to a model whose checkpoint has no tokenizer files
    DUPLICATE = "duplicate"        # a request id already in flight
    UNAVAILABLE = "unavailable"    # warming up, draining, or no instance left
    EXHAUSTED = "exhausted"        # queue full, or admission refused a deadline it cannot meet
    DEADLINE = "deadline"          # a hard deadline passed (the request was aborted)
    ABORTED = "aborted"            # the request ended some other way
    INTERNAL = "internal"          # a server-side fault


class CallError(Exception):
    def __init__(self, failure: Failure, message: str, field: str | None = None):
        super().__init__(message)
        self.failure, self.field = failure, field


@dataclass(frozen=True, slots=True)
class Submitted:
    request_id: str


@dataclass(frozen=True, slots=True)
class Step:
    """One denoising step of a streamed request: the whole answer area after it (token ids; the
    mask id where still masked), the step's number (from 1) and what it did."""

    step: int
    answer: tuple[int, ...]
    total_committed: int
    progress: StepProgress


@dataclass(frozen=True, slots=True)
class Finished:
    spec: GenerateSpec
    request: Request
    result: RequestResult

    @property
    def tokens(self) -> list[int]:
        """The answer's tokens before its first EOS, cut at what the caller asked for."""
        return list(self.result.tokens)[:self.spec.max_new_tokens]

    @property
    def stopped(self) -> bool:
        """True when the answer ended (EOS) within `max_new_tokens` (see `finish_reason`)."""
        return ended_by_eos(len(self.result.tokens), self.spec.max_new_tokens, self.spec.answer_length)


class _DeadlinePassed(Exception):
    pass


class Calls:
    """One per server: both frontends submit through it, so they share the cluster, the request-id
    space, the outcome counters and the drain."""

    def __init__(self, cluster, metrics=None):
        self.cluster, self.metrics = cluster, metrics
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def refusal(self) -> str | None:
        """Why a call would be refused as unavailable now (draining, warming up, no instance up), or None."""
        return DRAINING if self.draining else self.cluster.refusal()

    async def drain(self, grace_s: float) -> bool:
        """Refuse new calls and wait up to grace_s for in-flight ones; True if all finished."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=grace_s)
            return True
        except asyncio.TimeoutError:
            return False

    def count(self, outcome: str, deadline_met: bool | None = None) -> None:
        if self.metrics is not None:
            self.metrics.finished(outcome, deadline_met)

    def accept(self, request) -> GenerateSpec:
        """The checked spec of a `GenerateRequest`, or CallError (UNAVAILABLE, INVALID, NO_TOKENIZER)."""
        refusal = self.refusal()
        if refusal is not None:
            self.count("unavailable")
            raise CallError(Failure.UNAVAILABLE, refusal)
        try:
            return validate(request, self.cluster.tokenizer, self.cluster.limits)
        except InvalidRequest as err:
            self.count("invalid")
            raise CallError(Failure.INVALID, str(err), err.field) from None
        except TokenizerMissing as err:  # a checkpoint without tokenizer files: token-id prompts only
            self.count("invalid")
            raise CallError(Failure.NO_TOKENIZER, str(err)) from None

    async def run(self, spec: GenerateSpec, *, stream: bool, deadline_s: float | None = None, hard: bool = False):
        """Submit `spec` and yield Submitted, the Steps (when `stream`), then Finished. The request is
        scheduled for the earlier of `deadline_s` from now (a gRPC deadline, an HTTP timeout
        header) and its `slo_ms`, whichever are given, else the server default (a generous
        transport timeout does not loosen an SLO the caller asked for); `hard`: when `deadline_s`
        passes, abort it and raise CallError(DEADLINE)."""
        given = [s for s in (deadline_s, spec.slo_s) if s is not None]
        slo_s = min(given) if given else self.cluster.limits.default_slo_ms / 1000.0
        now = self.cluster.clock()
        req = Request(spec.request_id, spec.prompt_tokens, spec.answer_length, spec.block_length, now, now + slo_s,
                      tau_min=spec.tau_min, tau_max=spec.tau_max, temperature=spec.temperature, seed=spec.seed,
                      max_accuracy_drop=spec.max_accuracy_drop, strict_admission=spec.strict_admission)
        loop = asyncio.get_running_loop()
        expires = loop.time() + deadline_s if hard and deadline_s is not None else None
        updates: asyncio.Queue = asyncio.Queue()
        on_progress = (lambda p: loop.call_soon_threadsafe(updates.put_nowait, p)) if stream else None
        self._enter()
        try:
            try:
                handle = self.cluster.submit(req, on_progress)
            except DuplicateRequest as err:
                self.count("invalid")
                raise CallError(Failure.DUPLICATE, f"request_id: {err}", "request_id") from None
            except UNAVAILABLE_ERRORS as err:
                self.count("unavailable")
                raise CallError(Failure.UNAVAILABLE, str(err)) from None
            except Exception as err:  # a server-side fault: say so
                log.exception("submitting %s failed", spec.request_id)
                self.count("error")
                raise CallError(Failure.INTERNAL, f"server error: {type(err).__name__}: {err}") from None
            result_future = asyncio.wrap_future(handle.future)
            try:
                yield Submitted(spec.request_id)
                if stream:
                    answer = [self.cluster.tokenizer.mask_id] * spec.answer_length
                    step = 0
                    while (p := await _next_progress(updates, result_future, expires)) is not None:
                        for pos, tok in zip(p.positions, p.tokens):
                            if 0 <= pos < len(answer):
                                answer[pos] = tok
                        step += 1
                        yield Step(step, tuple(answer), p.committed, p)
                result = await _result(result_future, expires)
            except (asyncio.CancelledError, GeneratorExit):  # the caller is gone
                self.cluster.abort(spec.request_id)
                self.count("cancelled")
                raise
            except _DeadlinePassed:
                self.cluster.abort(spec.request_id)
                self.count("cancelled")
                raise CallError(Failure.DEADLINE, f"the deadline ({slo_s * 1e3:.0f} ms) passed; the request was "
                                "aborted") from None
            except UNAVAILABLE_ERRORS as err:  # every instance that could run it has failed
                self.count("unavailable")
                raise CallError(Failure.UNAVAILABLE, str(err)) from None
            except Exception as err:  # noqa: BLE001 - a server-side fault
                log.exception("request %s failed", spec.request_id)
                self.count("error")
                raise CallError(Failure.INTERNAL, f"server error: {type(err).__name__}: {err}") from None
            if result.state == RequestState.FINISHED_REJECTED:
                self.count("rejected")
                raise CallError(Failure.EXHAUSTED, f"rejected: {result.reject_reason}")
            if result.state != RequestState.FINISHED_OK:
                self.count(result.state.name.lower().removeprefix("finished_"))
                raise CallError(Failure.ABORTED, f"request ended as {result.state.name}")
            self.count("ok", result.deadline_met)
            yield Finished(spec, req, result)
        finally:
            self._leave()

    def _enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def _leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()


def _left(expires: float | None) -> float | None:
    return None if expires is None else max(0.0, expires - asyncio.get_running_loop().time())


async def _next_progress(updates: asyncio.Queue, result_future, expires: float | None):
    """The next step's progress; None once the result is in and every step before it was taken."""
    while True:
        if not updates.empty():
            return updates.get_nowait()
        if result_future.done():
            return None
        getter = asyncio.ensure_future(updates.get())
        try:
            await asyncio.wait({getter, result_future}, timeout=_left(expires), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not getter.done():
                getter.cancel()
        if getter.done() and not getter.cancelled():
            return getter.result()
        if not result_future.done():
            raise _DeadlinePassed


async def _result(result_future, expires: float | None) -> RequestResult:
    # shielded: cancelling this wait must not cancel the engine's future
    if expires is None:
        return await asyncio.shield(result_future)
    try:
        return await asyncio.wait_for(asyncio.shield(result_future), _left(expires))
    except asyncio.TimeoutError:
        raise _DeadlinePassed from None


def ended_by_eos(answer_tokens: int, max_new_tokens: int, answer_area: int) -> bool:
    """True when the answer ended (EOS) within what the caller asked for; False when it was cut by
    `max_new_tokens` or filled the whole area. `answer_tokens` counts the tokens before the first
    EOS in the untruncated answer area."""
    return answer_tokens < answer_area and answer_tokens <= max_new_tokens


def render_canvas(tok, answer) -> str:
    """One piece per answer position, so positions line up step after step: the token's text,
    '_' where still masked, END_MARK from the first EOS on (the answer has ended there)."""
    out, ended = [], False
    for t in answer:
        ended = ended or t == tok.eos_id
        if ended or t == tok.pad_id:
            out.append(END_MARK)
        elif t == tok.mask_id:
            out.append("_")
        else:
            out.append(tok.decode([t]) or "\ufffd")
    return "".join(out)
