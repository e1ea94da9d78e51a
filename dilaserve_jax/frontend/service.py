"""The DiLaServe gRPC servicer (grpc.aio) over a serving Cluster.

Engine threads report progress and results through thread-safe callbacks and futures; this module
bridges them into the event loop. A call that is cancelled (client gone, deadline passed) aborts
its request, which frees its slot at the next step.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from dilaserve_jax.frontend import dilaserve_pb2 as pb
from dilaserve_jax.frontend import dilaserve_pb2_grpc as pb_grpc
from dilaserve_jax.frontend.validation import GenerateSpec, InvalidRequest, validate
from dilaserve_jax.serving.request import Request, RequestState

log = logging.getLogger(__name__)


class DiLaServeService(pb_grpc.DiLaServeServicer):
    def __init__(self, cluster, metrics=None):
        self.cluster = cluster
        self.metrics = metrics
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
        if not request.directory:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "directory: required")
        step = request.step if request.HasField("step") else None
        try:
            source, seconds = await asyncio.to_thread(self.cluster.reload, request.directory, step)
        except (FileNotFoundError, ValueError) as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"directory: {err}")
        return pb.ReloadWeightsResponse(model=source, seconds=seconds)

    async def Reconfigure(self, request, context):
        await _check_parsed(request, context)
        if not request.mesh:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "mesh: required")
        reconfigure = getattr(self.cluster, "reconfigure", None)
        if reconfigure is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this server cannot reshape its layout at run time")
        try:
            await asyncio.to_thread(reconfigure, request.mesh)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"mesh: {err}")
        return self._cluster_state()

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
        return pb.ClusterState(
            layout=state["layout"], policy=state["policy"], model=state["model"],
            model_family=state.get("model_family", ""), serving=not self.draining,
            instances=[pb.InstanceState(**inst) for inst in state["instances"]])

    async def _run(self, request, context, stream: bool):
        await _check_parsed(request, context)
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is draining; retry on another replica")
        if not self.cluster.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is still compiling and warming up")
        try:
            spec = validate(request, self.cluster.tokenizer, self.cluster.limits)
        except InvalidRequest as err:
            self._count("invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the call's deadline has already passed")
        slo_s = remaining if remaining is not None else (spec.slo_s or self.cluster.limits.default_slo_ms / 1000.0)
        now = self.cluster.clock()
        req = Request(spec.request_id, spec.prompt_tokens, spec.answer_length, spec.block_length, now, now + slo_s,
                      tau_min=spec.tau_min, tau_max=spec.tau_max, temperature=spec.temperature, seed=spec.seed)

        loop = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()
        on_progress = (lambda p: loop.call_soon_threadsafe(updates.put_nowait, p)) if stream else None
        self._enter()
        try:
            try:
                handle = self.cluster.submit(req, on_progress)
            except ValueError as err:  # duplicate id
                await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {err}")
            except RuntimeError as err:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
            except Exception as err:  # a server-side fault: say so instead of gRPC's bare UNKNOWN
                log.exception("submitting %s failed", spec.request_id)
                self._count("error")
                await context.abort(grpc.StatusCode.INTERNAL, f"server error: {type(err).__name__}: {err}")
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
            except Exception as err:  # the instance failed while running this request
                log.exception("request %s failed", spec.request_id)
                self._count("error")
                await context.abort(grpc.StatusCode.INTERNAL, f"server error: {type(err).__name__}: {err}")
            if result.state == RequestState.FINISHED_REJECTED:
                self._count("rejected")
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"rejected: {result.reject_reason}")
            if result.state != RequestState.FINISHED_OK:
                self._count(result.state.name.lower().removeprefix("finished_"))
                await context.abort(grpc.StatusCode.ABORTED, f"request ended as {result.state.name}")
            self._count("ok", result.deadline_met)
            yield self._final(spec, req, result, handle.instance)
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
        shown = answer[:spec.max_new_tokens]
        if tok.eos_id in shown:
            shown = shown[:shown.index(tok.eos_id)]
        return pb.StepUpdate(step=step, canvas=tok.decode(shown, show_masks=True),
                             tokens_committed=len(p.positions) if p else 0, total_committed=total,
                             tau=p.tau if p else 0.0, step_kind=p.kind.name.lower() if p else "")

    def _final(self, spec: GenerateSpec, req: Request, result, instance: str) -> pb.GenerateResponse:
        tokens = list(result.tokens)[:spec.max_new_tokens]
        reason = pb.FINISH_REASON_STOP if len(result.tokens) < spec.answer_length else pb.FINISH_REASON_LENGTH
        start = result.start if result.start is not None else result.finish
        return pb.GenerateResponse(
            request_id=spec.request_id, text=self.cluster.tokenizer.decode(tokens), token_ids=tokens,
            finish_reason=reason, steps=result.steps, mean_tau=result.mean_tau or 0.0,
            queue_ms=(start - result.arrival) * 1e3, decode_ms=(result.finish - start) * 1e3,
            total_ms=(result.finish - result.arrival) * 1e3, deadline_met=result.deadline_met,
            deadline_ms=(req.deadline - req.arrival) * 1e3,
            instance=instance or "")

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


async def _check_parsed(request, context) -> None:
    if not hasattr(request, "DESCRIPTOR"):  # server.MalformedRequest: the bytes were not a valid message
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: malformed message ({request.error})")


def _apply(answer: list[int], progress, step: int, total: int) -> tuple[int, int]:
    for pos, tok in zip(progress.positions, progress.tokens):
        if 0 <= pos < len(answer):
            answer[pos] = tok
    return step + 1, progress.committed
