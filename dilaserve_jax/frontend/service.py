"""The DiLaServe gRPC servicer (grpc.aio) over a serving Cluster.

Engine threads report progress and results through thread-safe callbacks and futures; this module
bridges them into the event loop. A call that is cancelled (client gone, deadline passed) aborts
its request, which frees its slot at the next step. Every error detail is bounded in length.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Iterable

import grpc

from dilaserve_jax.frontend import dilaserve_pb2 as pb
from dilaserve_jax.frontend import dilaserve_pb2_grpc as pb_grpc
from dilaserve_jax.frontend.admin import MAX_PATH_BYTES, bounded, reload_refusal, weights_roots
from dilaserve_jax.frontend.validation import GenerateSpec, InvalidRequest, validate
from dilaserve_jax.models.tokenizer import TokenizerMissing
from dilaserve_jax.serving.cluster.cluster import Cluster, ClusterBusy, DuplicateRequest
from dilaserve_jax.serving.cluster.state import CheckpointWatchState
from dilaserve_jax.serving.cluster.weights_swap import IncompatibleWeights
from dilaserve_jax.serving.cluster.engine_types import EngineUnavailable
from dilaserve_jax.serving.policy.quality import QualitySnapshot
from dilaserve_jax.serving.policy.request import Request, RequestState
from dilaserve_jax.serving.policy.router import NoInstanceAvailable

log = logging.getLogger(__name__)
END_MARK = "\u00b7"  # canvas positions after the answer's end (EOS)
UNAVAILABLE_ERRORS = (EngineUnavailable, NoInstanceAvailable)
DRAINING = "server is draining; retry on another replica"


class DiLaServeService(pb_grpc.DiLaServeServicer):
    def __init__(self, cluster: Cluster, metrics=None, weights_roots_extra: Iterable[str] = ()):
        self.cluster = cluster
        self.metrics = metrics
        # fixed at start-up: the served model's directory then, plus the given ones
        self.weights_roots = weights_roots(cluster.model_source, weights_roots_extra)
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    # --- RPCs ---
    async def Generate(self, request, context):
        final = None
        async for event in self._run(request, context, stream=False):
            final = event
        return final

    async def GenerateStream(self, request, context):
        async for event in self._run(request, context, stream=True):
            if isinstance(event, pb.StepUpdate):
                yield pb.GenerateStreamResponse(update=event)
            else:
                yield pb.GenerateStreamResponse(final=event)

    async def GetClusterState(self, request, context):
        await _check_parsed(request, context)
        return self._cluster_state()

    async def ReloadWeights(self, request, context):
        await _check_parsed(request, context)
        directory = request.directory
        if not directory:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "directory: required")
        if len(directory.encode()) > MAX_PATH_BYTES or "\x00" in directory:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                         f"directory: not a usable path ({len(directory.encode())} bytes; at most {MAX_PATH_BYTES}, "
                         "no NUL)")
        if request.HasField("step") and request.step < 0:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"step: must be >= 0, got {request.step}")
        refusal = reload_refusal(directory, self.weights_roots)
        if refusal is not None:
            await _abort(context, grpc.StatusCode.PERMISSION_DENIED, refusal)
        step = request.step if request.HasField("step") else None
        try:
            report = await asyncio.to_thread(self.cluster.reload, directory, step)
        except (ClusterBusy, IncompatibleWeights) as err:
            await _abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(err))
        except (ValueError, OSError) as err:  # WeightsError and plain I/O errors: the input is unusable
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"directory: {err}")
        except Exception as err:  # noqa: BLE001 - the old weights keep serving either way
            log.exception("reload from %s failed", bounded(directory, 200))
            await _abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                         f"reload failed, the old weights keep serving: {type(err).__name__}: {err}")
        log.info("reloaded weights from %s in %.2f s", report.source, report.seconds)
        return pb.ReloadWeightsResponse(model=report.source, seconds=report.seconds)

    async def Reconfigure(self, request, context):
        await _check_parsed(request, context)
        if not request.mesh:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "mesh: required")
        if self.cluster.builder is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this server cannot reshape its layout at run time")
        scaler = self.cluster.autoscaler
        if scaler is not None and not scaler.manual_allowed:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "the controller is in auto mode; pause it first (SetControllerMode 'paused')")
        try:
            report = await asyncio.to_thread(self.cluster.reconfigure, request.mesh[:256], "manual")
        except ClusterBusy as err:
            await _abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(err))
        except ValueError as err:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"mesh: {err}")
        log.info("reconfigured: %s", report)
        return self._cluster_state()

    async def SetControllerMode(self, request, context):
        await _check_parsed(request, context)
        scaler = self.cluster.autoscaler
        if scaler is None or scaler.mode == "manual":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this server runs without a controller (serve --controller manual)")
        if request.mode not in ("auto", "paused"):
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"mode: must be 'auto' or 'paused', got "
                                                                     f"{request.mode[:64]!r}")
        scaler.set_mode(request.mode)
        log.info("controller mode: %s", request.mode)
        return self._cluster_state()

    # --- availability ---
    def refusal(self) -> str | None:
        """Why a Generate call would be answered UNAVAILABLE now, or None when it would be accepted
        (draining, warming up, no instance up). GetClusterState's `serving` is this being None, so
        the two never disagree."""
        return DRAINING if self.draining else self.cluster.refusal()

    # --- draining ---
    async def drain(self, grace_s: float) -> bool:
        """Refuse new calls and wait up to grace_s for in-flight ones; True if all finished."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=grace_s)
            return True
        except asyncio.TimeoutError:
            return False

    # --- internals ---
    def _cluster_state(self) -> pb.ClusterState:
        state = self.cluster.state()
        instances = [pb.InstanceState(**{**_fields(inst), "error": bounded(inst.error, 512),
                                         "quality": _quality(inst.quality)}) for inst in state.instances]
        return pb.ClusterState(
            layout=state.layout, policy=state.policy, model=state.model, family=state.family,
            serving=self.refusal() is None,
            instances=instances, failures={k: bounded(v, 512) for k, v in state.failures.items()},
            migrations=state.migrations, reloads=state.reloads, in_flight=state.in_flight,
            controller_mode=state.controller.mode, decisions=state.controller.decisions,
            reconfigurations=state.reconfigurations, recent_migrations=state.controller.recent_migrations,
            weight_updates=state.weight_updates, checkpoint_watch=_watch_state(state.checkpoint_watch))

    async def _run(self, request, context, stream: bool):
        await _check_parsed(request, context)
        refusal = self.refusal()
        if refusal is not None:
            self._count("unavailable")
            await _abort(context, grpc.StatusCode.UNAVAILABLE, refusal)
        try:
            spec = validate(request, self.cluster.tokenizer, self.cluster.limits)
        except InvalidRequest as err:
            self._count("invalid")
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except TokenizerMissing as err:  # a checkpoint without tokenizer files: token-id prompts only
            self._count("invalid")
            await _abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(err))
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the call's deadline has already passed")
        slo_s = remaining if remaining is not None else (spec.slo_s or self.cluster.limits.default_slo_ms / 1000.0)
        now = self.cluster.clock()
        req = Request(spec.request_id, spec.prompt_tokens, spec.answer_length, spec.block_length, now, now + slo_s,
                      tau_min=spec.tau_min, tau_max=spec.tau_max, temperature=spec.temperature, seed=spec.seed,
                      max_accuracy_drop=spec.max_accuracy_drop, strict_admission=spec.strict_admission)

        loop = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()
        on_progress = (lambda p: loop.call_soon_threadsafe(updates.put_nowait, p)) if stream else None
        self._enter()
        try:
            try:
                handle = self.cluster.submit(req, on_progress)
            except DuplicateRequest as err:
                self._count("invalid")
                await _abort(context, grpc.StatusCode.ALREADY_EXISTS, f"request_id: {err}")
            except UNAVAILABLE_ERRORS as err:
                self._count("unavailable")
                await _abort(context, grpc.StatusCode.UNAVAILABLE, str(err))
            except Exception as err:  # a server-side fault: say so instead of gRPC's bare UNKNOWN
                log.exception("submitting %s failed", spec.request_id)
                self._count("error")
                await _abort(context, grpc.StatusCode.INTERNAL, f"server error: {type(err).__name__}: {err}")
            await context.send_initial_metadata((("x-request-id", spec.request_id),))
            result_future = asyncio.wrap_future(handle.future)
            try:
                if stream:
                    async for update in self._updates(spec, updates, result_future):
                        yield update
                result = await result_future
            except asyncio.CancelledError:
                self.cluster.abort(spec.request_id)
                self._count("cancelled")
                raise
            except UNAVAILABLE_ERRORS as err:  # every instance that could run it has failed
                self._count("unavailable")
                await _abort(context, grpc.StatusCode.UNAVAILABLE, str(err))
            except Exception as err:  # noqa: BLE001 - a server-side fault
                log.exception("request %s failed", spec.request_id)
                self._count("error")
                await _abort(context, grpc.StatusCode.INTERNAL, f"server error: {type(err).__name__}: {err}")
            if result.state == RequestState.FINISHED_REJECTED:
                self._count("rejected")
                await _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"rejected: {result.reject_reason}")
            if result.state != RequestState.FINISHED_OK:
                self._count(result.state.name.lower().removeprefix("finished_"))
                await context.abort(grpc.StatusCode.ABORTED, f"request ended as {result.state.name}")
            self._count("ok", result.deadline_met)
            yield self._final(spec, req, result)
        finally:
            self._leave()

    async def _updates(self, spec: GenerateSpec, updates: asyncio.Queue, result_future):
        tok = self.cluster.tokenizer
        answer = [tok.mask_id] * spec.answer_length
        step = total = 0
        while True:
            getter = asyncio.ensure_future(updates.get())
            done, _ = await asyncio.wait({getter, result_future}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                while not updates.empty():  # flush steps reported before the result
                    step, total = _apply(answer, updates.get_nowait(), step, total)
                    yield self._update(tok, answer, spec, step, total)
                return
            p = getter.result()
            step, total = _apply(answer, p, step, total)
            yield self._update(tok, answer, spec, step, total, p)

    @staticmethod
    def _update(tok, answer, spec, step, total, p=None) -> pb.StepUpdate:
        return pb.StepUpdate(step=step, canvas=render_canvas(tok, answer[:spec.max_new_tokens]),
                             tokens_committed=len(p.positions) if p else 0, total_committed=total,
                             tau=p.tau if p else 0.0, step_kind=p.kind.label if p else "")

    def _final(self, spec: GenerateSpec, req: Request, result) -> pb.GenerateResponse:
        tokens = list(result.tokens)[:spec.max_new_tokens]
        reason = finish_reason(len(result.tokens), spec.max_new_tokens, spec.answer_length)
        start = result.start if result.start is not None else result.finish
        return pb.GenerateResponse(
            request_id=spec.request_id, text=self.cluster.tokenizer.decode(tokens), token_ids=tokens,
            finish_reason=reason, steps=result.steps, mean_tau=result.mean_tau or 0.0,
            queue_ms=(start - result.arrival) * 1e3, decode_ms=(result.finish - start) * 1e3,
            total_ms=(result.finish - result.arrival) * 1e3, deadline_met=result.deadline_met,
            deadline_ms=(req.deadline - req.arrival) * 1e3,
            instance=result.instance, moves=result.moves, taus=result.taus,
            predicted_accuracy_loss=result.predicted_loss)

    def _count(self, outcome: str, deadline_met: bool | None = None) -> None:
        if self.metrics is not None:
            self.metrics.finished(outcome, deadline_met)

    def _enter(self):
        self.in_flight += 1
        self._idle.clear()

    def _leave(self):
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()


def finish_reason(answer_tokens: int, max_new_tokens: int, answer_area: int) -> int:
    """STOP when the answer ended (EOS) within what the caller asked for; LENGTH when it was cut by
    `max_new_tokens` or filled the whole area. `answer_tokens` counts the tokens before the first
    EOS in the untruncated answer area."""
    ended = answer_tokens < answer_area
    return pb.FINISH_REASON_STOP if ended and answer_tokens <= max_new_tokens else pb.FINISH_REASON_LENGTH


def render_canvas(tok, answer: list[int]) -> str:
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


def _watch_state(watch: CheckpointWatchState | None) -> pb.CheckpointWatch | None:
    if watch is None:
        return None
    return pb.CheckpointWatch(**{**_fields(watch), "last_error": bounded(watch.last_error, 512)})


async def _abort(context, code: grpc.StatusCode, message: str) -> None:
    await context.abort(code, bounded(message))


async def _check_parsed(request, context) -> None:
    if not hasattr(request, "DESCRIPTOR"):  # server.MalformedRequest: the bytes were not a valid message
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: malformed message ({request.error})")


def _apply(answer: list[int], progress, step: int, total: int) -> tuple[int, int]:
    for pos, tok in zip(progress.positions, progress.tokens):
        if 0 <= pos < len(answer):
            answer[pos] = tok
    return step + 1, progress.committed


def _quality(q: QualitySnapshot | None) -> pb.QualityState | None:
    """An instance's budget accounting (unbounded budget / allowance: fields left unset)."""
    if q is None:
        return None
    return pb.QualityState(**{k: v for k, v in q.as_dict().items() if v is not None})


def _fields(state) -> dict:
    """A state dataclass's fields, one level deep (the proto message of the same shape takes them)."""
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
