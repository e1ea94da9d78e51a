"""The engine of one instance: schedule → run the step on the runner → update, in a loop.

Ownership rule. The engine thread is the only code that touches this instance's runner,
scheduler, threshold controller and the requests they hold. Every other thread (gRPC workers,
the cluster, a weight push, a profiler) goes through the mailbox: `submit`, `abort` and `call`
enqueue an operation that the loop applies between two steps, and the caller waits on a
`concurrent.futures.Future`. Callers read only the immutable `EngineSnapshot` the loop publishes
after every iteration. One exception, and it is a hand-over, not sharing: when the instance
fails (its runner raised, or a runner call outlived the watchdog), `fail` takes the `_owner`
lock, which the loop holds everywhere except inside runner calls, marks the engine FAILED and
takes its unfinished requests away; the loop notices on its next acquisition and exits without
touching them again.

A thread per instance: the jitted step call releases the GIL while the device works, so
instances on separate devices overlap, and each loop's timing is independent of the others'
step lengths. Progress callbacks run on the engine thread and must be quick (from asyncio, hand
over with `loop.call_soon_threadsafe`).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Sequence

from dilaserve_jax.serving.cluster.engine_types import (EngineUnavailable, FailureFn, Handoff, HungStep, ProgressFn,
                                                        RequestHandle, RequestResult, StepHook, StepProgress,
                                                        describe_error, fail_future, resolve_future)
from dilaserve_jax.serving.cluster.iteration_trace import NO_TRACE
from dilaserve_jax.serving.policy.snapshots import EngineSnapshot, EngineState, own_time
from dilaserve_jax.serving.policy.request import Request, RequestState
from dilaserve_jax.serving.policy.scheduler import Scheduler
from dilaserve_jax.serving.policy.types import Runner, StepPlan

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, runner: Runner, scheduler: Scheduler, clock: Callable[[], float] = time.monotonic,
                 name: str = "instance-0") -> None:
        if runner.num_slots != scheduler.cfg.num_slots:
            raise ValueError(f"runner has {runner.num_slots} slots, scheduler {scheduler.cfg.num_slots}")
        self.runner, self.scheduler, self.clock, self.name = runner, scheduler, clock, name
        self.on_failure: FailureFn | None = None  # set by the cluster before start
        self._cv = threading.Condition()  # the mailbox: ops, handles, snapshot, state
        self._owner = threading.Lock()  # held by the loop except inside runner calls (see module doc)
        self._ops: deque[tuple[str, Any]] = deque()
        self._handles: dict[str, tuple[Future, ProgressFn | None]] = {}
        self._pending: dict[str, float] = {}  # submitted, not yet scheduled: predicted seconds of work
        self._hooks: tuple[StepHook, ...] = ()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._state = EngineState.CREATED
        self._runner_call_since: float | None = None  # monotonic start of the runner call in progress
        self.error: BaseException | None = None
        self.steps = 0
        self.tracer = NO_TRACE  # an IterationTracer records every iteration (set before the loop starts)
        self._snapshot = EngineSnapshot(name, self._state, scheduler.snapshot(clock()), (), 0, None)

    # --- thread-safe API ---
    def submit(self, request: Request, on_progress: ProgressFn | None = None, future: Future | None = None,
               speed_ratio: float | None = None, own_seconds: float | None = None) -> RequestHandle:
        """Queue a request (new, or moved here with its caller's `future`); applied between steps.
        own_seconds: its predicted time here when the router already worked it out (`Placement`)."""
        fut = future if future is not None else Future()
        work = own_time(self.snapshot().load, request) if own_seconds is None else own_seconds
        with self._cv:
            if self._state in (EngineState.STOPPED, EngineState.FAILED):
                raise EngineUnavailable(f"instance {self.name} is {self._state.name.lower()}", self.error)
            if request.id in self._handles:
                raise ValueError(f"duplicate request id {request.id!r}")
            self._handles[request.id] = (fut, on_progress)
            self._pending[request.id] = work
            self._ops.append(("add", (request, speed_ratio)))
            self._cv.notify()
        return RequestHandle(request.id, fut, lambda: self.name, lambda: self.abort(request.id))

    def abort(self, request_id: str) -> None:
        """Cancel; applied between steps (the slot is released at the next schedule)."""
        self._post("abort", request_id)

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn()` on the engine thread between two steps; its result or exception comes back in
        the future. How other threads reach the runner, scheduler or controller."""
        fut: Future = Future()
        self._post("call", (fn, fut))
        return fut

    def set_latency_model(self, latency) -> Future:
        return self.call(lambda: self.scheduler.set_latency_model(latency))

    def swap_weights(self, params) -> Future:
        """Swap the runner's weights between two steps; running requests refresh at their next step
        (their cached K/V came from the old weights). The future's result is the swap's clock time."""
        def swap() -> float:
            self.runner.reload(params)
            self.scheduler.invalidate_caches()
            return self.clock()
        return self.call(swap)

    def add_step_hook(self, hook: StepHook) -> None:
        """`hook(name, plan, outcomes, t0, t1)` runs on the engine thread after every step (from the
        next iteration on). The hooks are an immutable tuple swapped whole, so the loop never sees
        the collection change under it."""
        with self._cv:
            self._hooks = (*self._hooks, hook)

    def remove_step_hook(self, hook: StepHook) -> None:
        with self._cv:
            hooks = list(self._hooks)
            hooks.remove(hook)
            self._hooks = tuple(hooks)

    def hand_over(self, request_ids: Sequence[str] | None = None) -> Future:
        """Take requests (default: all) off this instance at the next step boundary, unfinished;
        the future's result is their `Handoff`s (for `submit(..., future=...)` elsewhere)."""
        ids = None if request_ids is None else tuple(request_ids)
        return self.call(lambda: self._detach(ids))

    def snapshot(self) -> EngineSnapshot:
        """The loop's latest published state, with the work submitted since (not yet scheduled)."""
        with self._cv:
            snap = self._snapshot
            pending = tuple(self._pending.values())
            return snap if pending == snap.pending else dataclasses.replace(snap, pending=pending)

    @property
    def state(self) -> EngineState:
        with self._cv:
            return self._state

    @property
    def healthy(self) -> bool:
        return self.state in (EngineState.CREATED, EngineState.RUNNING)

    # --- lifecycle ---
    def start(self) -> "Engine":
        with self._cv:
            if self._thread is not None and self._thread.is_alive():
                raise RuntimeError(f"engine {self.name} is already running")
            if self._state in (EngineState.STOPPED, EngineState.FAILED):
                raise RuntimeError(f"engine {self.name} is {self._state.name.lower()}; build a new one")
            self._stop = False
            self._state = EngineState.RUNNING
            self._thread = threading.Thread(target=self._loop, name=f"engine-{self.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop the loop after its current iteration; requests still here fail with EngineUnavailable
        (drain first). Raises TimeoutError if the loop does not stop within `timeout` — the engine
        then stays unusable instead of risking two loops over one scheduler."""
        with self._cv:
            self._stop = True
            self._cv.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                raise TimeoutError(f"engine {self.name} did not stop within {timeout} s (a step is still running)")
        with self._cv:
            if self._state != EngineState.FAILED:
                self._state = EngineState.STOPPED
            handles, self._handles = self._handles, {}
            ops, self._ops = list(self._ops), deque()
            self._pending.clear()
        err = EngineUnavailable(f"instance {self.name} stopped")
        for fut, _ in handles.values():
            fail_future(fut, err)
        for op, arg in ops:
            if op == "call":
                fail_future(arg[1], err)
        self._publish()

    def fail(self, error: BaseException) -> bool:
        """Mark the engine FAILED and hand its unfinished requests to `on_failure` (or fail them).
        Safe from any thread; waits for the loop to be outside its bookkeeping. False if it had
        already stopped or failed."""
        with self._owner:
            return self._fail_locked(error)

    def check_hung(self, limit_s: float, now: float | None = None) -> bool:
        """Watchdog: fail the engine if a runner call has been running longer than `limit_s`."""
        since = self._runner_call_since
        now = time.monotonic() if now is None else now
        if since is None or now - since <= limit_s:
            return False
        return self.fail(HungStep(f"instance {self.name}: a runner call has run {now - since:.1f} s "
                                  f"(watchdog limit {limit_s:g} s)"))

    # --- the loop ---
    def step_once(self) -> bool:
        """One iteration on the calling thread; False when there was nothing to do. A fault fails
        the instance (its requests move on; see `fail`) instead of escaping."""
        try:
            return self._iterate()
        except Exception as e:  # noqa: BLE001
            log.exception("instance %s failed", self.name)
            self.fail(e)
            return False

    def _iterate(self) -> bool:
        sch, runner, tr = self.scheduler, self.runner, self.tracer
        with self._owner:
            if self._state == EngineState.FAILED:
                return False
            tr.begin()
            self._apply_ops()
            tr.lap("mailbox")
            plan = sch.schedule(self.clock())
            self._resolve(sch.pop_finished())
            tr.lap("schedule")
            if plan is None:
                self._publish()
                tr.end(None, sch)
                return False
        self._runner_calls(lambda: self._prepare(plan))
        tr.lap("prepare")
        if not plan.has_step:
            with self._owner:
                self._publish()
                tr.lap("publish")
                tr.end(plan, sch)
            return True
        t0 = self.clock()
        outcomes = self._runner_calls(lambda: runner.step(plan.kind, plan.slots, plan.taus, plan.blocks))
        t1 = self.clock()
        tr.lap("step")
        with self._owner:
            if self._state == EngineState.FAILED:  # taken over while the step ran: not ours any more
                return False
            reqs = [sch.running[s] for s in plan.slots]
            sch.update(plan, outcomes, t1)
            self.steps += 1
            for req, o, tau in zip(reqs, outcomes, plan.taus):
                self._progress(req, StepProgress(req.id, plan.kind, tau, o.positions, o.tokens, req.committed,
                                                 req.answer_length, t1, self.name))
            for hook in self._hooks:
                hook(self.name, plan, outcomes, t0, t1)
            tr.lap("update")
            self._resolve(sch.pop_finished())
            self._publish()
            tr.lap("publish")
            tr.end(plan, sch, t0, t1)
        return True

    def run_until_idle(self, max_iterations: int = 1_000_000) -> int:
        """Drive the loop on the calling thread until nothing is left (tests, simulation)."""
        for i in range(max_iterations):
            if not self.step_once():
                with self._cv:
                    if not self._ops or self._state == EngineState.FAILED:
                        return i
        raise RuntimeError(f"engine {self.name} not idle after {max_iterations} iterations")

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    if self._stop or self._state == EngineState.FAILED:
                        return
                if not self.step_once():
                    with self._cv:
                        while not self._ops and not self._stop and self._state != EngineState.FAILED:
                            self._cv.wait()
        except BaseException as e:  # noqa: BLE001 - any fault: the instance fails, its requests move
            log.exception("instance %s failed", self.name)
            self.fail(e)

    # --- internals (engine thread, `_owner` held unless noted) ---
    def _runner_calls(self, fn: Callable[[], Any]) -> Any:
        """Run runner work outside `_owner`, timed for the watchdog."""
        self._runner_call_since = time.monotonic()
        try:
            return fn()
        finally:
            self._runner_call_since = None

    def _prepare(self, plan: StepPlan) -> None:
        for slot in plan.releases:
            self.runner.release(slot)
        for a in plan.admits:
            if a.committed is None and a.steps_done == 0:
                self.runner.admit(a.slot, a.prompt_tokens, a.answer_length, a.block_length,
                                  temperature=a.temperature, seed=a.seed)
            else:
                self.runner.admit(a.slot, a.prompt_tokens, a.answer_length, a.block_length,
                                  temperature=a.temperature, seed=a.seed, committed=a.committed,
                                  steps_done=a.steps_done)

    def _post(self, op: str, arg: Any) -> None:
        with self._cv:
            self._ops.append((op, arg))
            self._cv.notify()

    def _apply_ops(self) -> None:
        with self._cv:
            ops, self._ops = list(self._ops), deque()
        now = self.clock()
        for op, arg in ops:
            if op == "add":
                req, ratio = arg
                with self._cv:
                    self._pending.pop(req.id, None)
                self.tracer.arrived(req.id, req.arrival)
                self.scheduler.add(req, now, ratio)
            elif op == "abort":
                self.scheduler.abort(arg)
            else:
                fn, fut = arg
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # noqa: BLE001 - handed to the caller
                        fut.set_exception(e)

    def _detach(self, ids: tuple[str, ...] | None) -> list[Handoff]:
        sch, now = self.scheduler, self.clock()
        wanted = list(sch.requests) if ids is None else [i for i in ids if i in sch.requests]
        out = []
        for rid in wanted:
            req, ratio = sch.detach(rid, now)
            with self._cv:
                fut, cb = self._handles.pop(rid)
            out.append(Handoff(req, fut, cb, ratio))
        try:
            self._publish()
        except Exception:  # noqa: BLE001 - the requests are off this instance now: hand them over anyway
            log.exception("publishing %s's state after a hand-over", self.name)
        return out

    def _fail_locked(self, error: BaseException) -> bool:
        with self._cv:
            if self._state in (EngineState.FAILED, EngineState.STOPPED):
                return False
            self._state = EngineState.FAILED
            self.error = error
            self._snapshot = dataclasses.replace(self._snapshot, state=self._state, error=describe_error(error))
            ops, self._ops = list(self._ops), deque()
            self._pending.clear()
            self._cv.notify_all()
        log.error("instance %s failed: %s: %s", self.name, type(error).__name__, error)
        sch, now = self.scheduler, self.clock()
        aborted = {arg for op, arg in ops if op == "abort"}
        moving: list[Request] = []
        for op, arg in ops:
            if op == "add":
                moving.append(arg[0])
            elif op == "call":
                fail_future(arg[1], EngineUnavailable(f"instance {self.name} failed", error))
        ratios: dict[str, float | None] = {}
        for rid, req in list(sch.requests.items()):
            try:
                _, ratios[rid] = sch.detach(rid, now)
            except Exception:  # noqa: BLE001 - a broken scheduler must not keep requests hostage
                log.exception("detaching %s from failed instance %s", rid, self.name)
                sch.requests.pop(rid, None)
                if not req.finished:
                    req.slot = None
                    req.detach(now)
            if not req.finished:
                moving.append(req)
        self._resolve(sch.pop_finished())
        handoffs, doomed = [], []
        with self._cv:
            for req in moving:
                fut, cb = self._handles.pop(req.id, (None, None))
                if fut is None:
                    continue
                if req.id in aborted:
                    doomed.append((req, fut))
                else:
                    handoffs.append(Handoff(req, fut, cb, ratios.get(req.id)))
            leftovers, self._handles = self._handles, {}
        for req, fut in doomed:
            req.transition(RequestState.FINISHED_ABORTED, now)
            resolve_future(fut, RequestResult.of(req, self.name))
        for fut, _ in leftovers.values():
            fail_future(fut, EngineUnavailable(f"instance {self.name} failed", error))
        self._publish()
        if self.on_failure is not None:
            self.on_failure(self, handoffs, error)
        else:
            for h in handoffs:
                fail_future(h.future, EngineUnavailable(f"instance {self.name} failed: {error}", error))
        return True

    def _progress(self, req: Request, p: StepProgress) -> None:
        with self._cv:
            cb = self._handles.get(req.id, (None, None))[1]
        if cb is not None:
            try:
                cb(p)
            except Exception:  # a caller's callback must not stop the instance
                log.exception("progress callback for %s failed", req.id)

    def _resolve(self, finished: list[Request]) -> None:
        for r in finished:
            with self._cv:
                fut, _ = self._handles.pop(r.id, (None, None))
            if fut is not None:
                resolve_future(fut, RequestResult.of(r, self.name))

    def _publish(self) -> None:
        load = self.scheduler.snapshot(self.clock())
        with self._cv:
            err = None if self.error is None else describe_error(self.error)
            self._snapshot = EngineSnapshot(self.name, self._state, load, tuple(self._pending.values()),
                                            self.steps, err)
