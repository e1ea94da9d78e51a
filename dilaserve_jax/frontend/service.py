"""The DiLaServe gRPC servicer (grpc.aio) over a serving Cluster.

Engine threads report progress and results through thread-safe callbacks and futures; calls.py
bridges them into the event loop, for this service and the HTTP frontend alike. A call that is
cancelled (client gone, deadline passed) aborts its request, which frees its slot at the next
step. Every error detail is bounded in length.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from contextlib import aclosing
from typing import Iterable

import grpc

from dilaserve_jax.frontend import dilaserve_pb2 as pb
from dilaserve_jax.frontend import dilaserve_pb2_grpc as pb_grpc
from dilaserve_jax.frontend.admin import MAX_PATH_BYTES, bounded, reload_refusal, weights_roots
from dilaserve_jax.frontend.calls import (DRAINING, END_MARK, UNAVAILABLE_ERRORS, CallError, Calls, Failure, Step,
                                          Submitted, ended_by_eos, render_canvas)
from dilaserve_jax.frontend.validation import GenerateSpec
from dilaserve_jax.serving.cluster.cluster import Cluster, ClusterBusy
from dilaserve_jax.serving.cluster.state import CheckpointWatchState
from dilaserve_jax.serving.cluster.weights_swap import IncompatibleWeights
from dilaserve_jax.serving.policy.quality import QualitySnapshot
from dilaserve_jax.serving.policy.request import Request

__all__ = ["DRAINING", "END_MARK", "UNAVAILABLE_ERRORS", "DiLaServeService", "finish_reason", "render_canvas"]
log = logging.getLogger(__name__)
GRPC_CODES = {
    Failure.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    Failure.NO_TOKENIZER: grpc.StatusCode.FAILED_PRECONDITION,
    Failure.DUPLICATE: grpc.StatusCode.ALREADY_EXISTS,
    Failure.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Failure.EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Failure.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
    Failure.ABORTED: grpc.StatusCode.ABORTED,
    Failure.INTERNAL: grpc.StatusCode.INTERNAL,
}


class DiLaServeService(pb_grpc.DiLaServeServicer):
    def __init__(self, cluster: Cluster, metrics=None, weights_roots_extra: Iterable[str] = (),
                 calls: Calls | None = None):
        """`calls`: the generation path shared with the HTTP frontend (one is made when not given)."""
        self.cluster = cluster
        self.metrics = metrics
        self.calls = calls or Calls(cluster, metrics)
        # fixed at start-up: the served model's directory then, plus the given ones
        self.weights_roots = weights_roots(cluster.model_source, weights_roots_extra)

    @property
    def draining(self) -> bool:
        return self.calls.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.calls.draining = value

    @property
    def in_flight(self) -> int:
        return self.calls.in_flight

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
        the two never disagree; the HTTP frontend asks the same."""
        return self.calls.refusal()

    # --- draining ---
    async def drain(self, grace_s: float) -> bool:
        """Refuse new calls (gRPC and HTTP) and wait up to grace_s for in-flight ones; True if all finished."""
        return await self.calls.drain(grace_s)

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
        try:
            spec = self.calls.accept(request)
            remaining = context.time_remaining()
            if remaining is not None and remaining <= 0:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the call's deadline has already passed")
            tok = self.cluster.tokenizer
            async with aclosing(self.calls.run(spec, stream=stream, deadline_s=remaining)) as events:
                async for event in events:
                    if isinstance(event, Submitted):
                        await context.send_initial_metadata((("x-request-id", spec.request_id),))
                    elif isinstance(event, Step):
                        yield pb.StepUpdate(step=event.step, canvas=render_canvas(tok, event.answer[:spec.max_new_tokens]),
                                            tokens_committed=len(event.progress.positions),
                                            total_committed=event.total_committed, tau=event.progress.tau,
                                            step_kind=event.progress.kind.label)
                    else:
                        yield self._final(spec, event.request, event.result)
        except CallError as err:
            await _abort(context, GRPC_CODES[err.failure], str(err))

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


def finish_reason(answer_tokens: int, max_new_tokens: int, answer_area: int) -> int:
    """STOP when the answer ended (EOS) within what the caller asked for; LENGTH when it was cut by
    `max_new_tokens` or filled the whole area. `answer_tokens` counts the tokens before the first
    EOS in the untruncated answer area."""
    return pb.FINISH_REASON_STOP if ended_by_eos(answer_tokens, max_new_tokens, answer_area) \
        else pb.FINISH_REASON_LENGTH


def _watch_state(watch: CheckpointWatchState | None) -> pb.CheckpointWatch | None:
    if watch is None:
        return None
    return pb.CheckpointWatch(**{**_fields(watch), "last_error": bounded(watch.last_error, 512)})


async def _abort(context, code: grpc.StatusCode, message: str) -> None:
    await context.abort(code, bounded(message))


async def _check_parsed(request, context) -> None:
    if not hasattr(request, "DESCRIPTOR"):  # server.MalformedRequest: the bytes were not a valid message
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: malformed message ({request.error})")


def _quality(q: QualitySnapshot | None) -> pb.QualityState | None:
    """An instance's budget accounting (unbounded budget / allowance: fields left unset)."""
    if q is None:
        return None
    return pb.QualityState(**{k: v for k, v in q.as_dict().items() if v is not None})


def _fields(state) -> dict:
    """A state dataclass's fields, one level deep (the proto message of the same shape takes them)."""
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
