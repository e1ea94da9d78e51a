"""The engine of one instance: schedule → run the step on the runner → update, in a loop.

Threading model: one Engine per instance, each looping in its own thread. The jitted step call
(dispatch and the wait for its result) releases the GIL, so per-instance threads overlap on their
separate devices while Python scheduling work is small; a thread per instance also keeps each
loop's timing independent of the others' step lengths (one loop dispatching all instances would
have to poll and join heterogeneous steps). The scheduler and runner are touched only by the loop
thread. `submit` and `abort` are thread-safe: they enqueue operations that the loop applies between
steps; results come back through a `concurrent.futures.Future` (use `asyncio.wrap_future` from
asyncio) and an optional per-step progress callback, which runs on the engine thread and must be
quick (from asyncio, hand it over with `loop.call_soon_threadsafe`).
"""
from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Sequence

from dilaserve_jax.serving.request import Request, RequestState
from dilaserve_jax.serving.scheduler import LoadSnapshot, Scheduler
from dilaserve_jax.serving.types import Runner, SlotOutcome, StepKind, StepPlan

log = logging.getLogger(__name__)


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

    @classmethod
    def of(cls, r: Request) -> "RequestResult":
        return cls(r.id, r.state, tuple(r.output_tokens or ()), bool(r.deadline_met), r.arrival, r.start_time,
                   r.finish_time, len(r.steps), r.mean_tau(), r.reject_reason)


ProgressFn = Callable[[StepProgress], None]
StepHook = Callable[[str, StepPlan, Sequence[SlotOutcome], float, float], None]  # name, plan, outcomes, t0, t1


class RequestHandle:
    def __init__(self, request_id: str, future: Future, engine: "Engine") -> None:
        self.request_id, self.future, self._engine = request_id, future, engine

    def result(self, timeout: float | None = None) -> RequestResult:
        return self.future.result(timeout)

    @property
    def instance(self) -> str:
        """Name of the engine (instance) serving this request."""
        return self._engine.name

    def done(self) -> bool:
        return self.future.done()

    def abort(self) -> None:
        self._engine.abort(self.request_id)


class Engine:
    def __init__(self, runner: Runner, scheduler: Scheduler, clock: Callable[[], float] = time.monotonic,
                 name: str = "instance-0") -> None:
        if runner.num_slots != scheduler.cfg.num_slots:
            raise ValueError(f"runner has {runner.num_slots} slots, scheduler {scheduler.cfg.num_slots}")
        self.runner, self.scheduler, self.clock, self.name = runner, scheduler, clock, name
        self._ops: deque[tuple[str, object]] = deque()
        self._cv = threading.Condition()
        self._handles: dict[str, tuple[Future, ProgressFn | None]] = {}
        self._pending_work: dict[str, float] = {}  # submitted, not yet seen by the scheduler
        self._snapshot = scheduler.snapshot(clock())
        self._lat_scale = dict(scheduler.lat_scale)
        self._thread: threading.Thread | None = None
        self._stop = False
        self._hooks: list[StepHook] = []
        self.error: BaseException | None = None
        self.steps = 0

    # --- thread-safe API ---
    def submit(self, request: Request, on_progress: ProgressFn | None = None) -> RequestHandle:
        fut: Future = Future()
        est = self._own_time(request, self._snapshot)
        with self._cv:
            if self.error is not None:
                raise RuntimeError(f"engine {self.name} failed") from self.error
            if request.id in self._handles:
                raise ValueError(f"duplicate request id {request.id!r}")
            self._handles[request.id] = (fut, on_progress)
            self._pending_work[request.id] = est
            self._ops.append(("add", request))
            self._cv.notify()
        return RequestHandle(request.id, fut, self)

    def abort(self, request_id: str) -> None:
        """Cancel; applied between steps (the slot is released at the next schedule)."""
        with self._cv:
            self._ops.append(("abort", request_id))
            self._cv.notify()

    def add_step_hook(self, hook: StepHook) -> None:
        """Called on the engine thread after every step (measurement, metrics)."""
        self._hooks.append(hook)

    def remove_step_hook(self, hook: StepHook) -> None:
        self._hooks.remove(hook)

    def snapshot(self) -> LoadSnapshot:
        with self._cv:
            return self._snapshot

    def predict_finish(self, request: Request, now: float | None = None) -> float:
        """Predicted finish of `request` if sent here now (queue + its own time at τ_max)."""
        with self._cv:
            snap, pending = self._snapshot, list(self._pending_work.values())
        now = self.clock() if now is None else now
        slots = [max(0.0, t - (now - snap.time)) for t in snap.running_left]
        slots += [0.0] * (snap.num_slots - len(slots))
        heapq.heapify(slots)
        for w in [*snap.waiting_left, *pending]:  # FIFO approximation of the queue
            heapq.heappush(slots, heapq.heappop(slots) + w)
        return now + heapq.heappop(slots) + self._own_time(request, snap)

    def _own_time(self, req: Request, snap: LoadSnapshot) -> float:
        sch = self.scheduler
        batch = max(1, min(snap.num_slots, len(snap.running_left) + len(snap.waiting_left) + 1))
        n_ref, n_reu = sch.controller.steps_needed(req, req.tau_max)
        lat, tp = sch.latency, sch.cfg.tp
        return (n_ref * lat.predict(StepKind.REFRESH, batch, req.canvas_length, req.block_length, tp)
                * self._lat_scale[StepKind.REFRESH]
                + n_reu * lat.predict(StepKind.REUSE, batch, req.canvas_length, req.block_length, tp)
                * self._lat_scale[StepKind.REUSE])

    # --- the loop ---
    def step_once(self) -> bool:
        """One iteration on the calling thread; False when there was nothing to do."""
        self._apply_ops()
        sch, runner = self.scheduler, self.runner
        plan = sch.schedule(self.clock())
        self._resolve(sch.pop_finished())
        if plan is None:
            self._publish()
            return False
        for slot in plan.releases:
            runner.release(slot)
        for a in plan.admits:
            runner.admit(a.slot, a.prompt_tokens, a.answer_length, a.block_length, temperature=a.temperature,
                         seed=a.seed)
        if plan.has_step:
            t0 = self.clock()
            outcomes = runner.step(plan.kind, plan.slots, plan.taus)
            t1 = self.clock()
            answers = {o.slot: runner.answer(o.slot) for o in outcomes if o.request_finished}
            reqs = [sch.running[s] for s in plan.slots]
            sch.update(plan, outcomes, t1)
            self.steps += 1
            for req, o, tau in zip(reqs, outcomes, plan.taus):
                if o.slot in answers:
                    req.output_tokens = answers[o.slot]
                self._progress(req, StepProgress(req.id, plan.kind, tau, o.positions, o.tokens, req.committed,
                                                 req.answer_length, t1))
            for hook in self._hooks:
                hook(self.name, plan, outcomes, t0, t1)
        self._resolve(sch.pop_finished())
        self._publish()
        return True

    def run_until_idle(self, max_iterations: int = 1_000_000) -> int:
        """Drive the loop on the calling thread until nothing is left (tests, simulation)."""
        for i in range(max_iterations):
            if not self.step_once() and not self._ops:
                return i
        raise RuntimeError(f"engine {self.name} not idle after {max_iterations} iterations")

    def start(self) -> "Engine":
        if self._thread is not None:
            raise RuntimeError("already started")
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name=f"engine-{self.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 5.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _loop(self) -> None:
        try:
            while not self._stop:
                if not self.step_once():
                    with self._cv:
                        while not self._ops and not self._stop:
                            self._cv.wait()
        except BaseException as e:  # fail every caller instead of hanging them
            log.exception("engine %s failed", self.name)
            with self._cv:
                self.error = e
                handles, self._handles = self._handles, {}
            for fut, _ in handles.values():
                if not fut.done():
                    fut.set_exception(e)

    # --- internals ---
    def _apply_ops(self) -> None:
        with self._cv:
            ops, self._ops = list(self._ops), deque()
        now = self.clock()
        for op, arg in ops:
            if op == "add":
                self.scheduler.add(arg, now)
                with self._cv:
                    self._pending_work.pop(arg.id, None)
            else:
                self.scheduler.abort(arg)

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
            if fut is not None and not fut.done():
                fut.set_result(RequestResult.of(r))

    def _publish(self) -> None:
        snap = self.scheduler.snapshot(self.clock())
        with self._cv:
            self._snapshot = snap
            self._lat_scale = dict(self.scheduler.lat_scale)


class StepTimeline:
    """Step hook recording (instance, start, end) of every step; measures cross-instance overlap."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.intervals: dict[str, list[tuple[float, float]]] = {}

    def __call__(self, name: str, plan: StepPlan, outcomes: Sequence[SlotOutcome], t0: float, t1: float) -> None:
        with self._lock:
            self.intervals.setdefault(name, []).append((t0, t1))

    def busy(self, name: str) -> float:
        return sum(b - a for a, b in self.intervals.get(name, []))

    def overlap(self, a: str, b: str) -> float:
        """Seconds during which both instances were inside a step."""
        total, xs, ys = 0.0, sorted(self.intervals.get(a, [])), sorted(self.intervals.get(b, []))
        i = j = 0
        while i < len(xs) and j < len(ys):
            lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
            total += max(0.0, hi - lo)
            if xs[i][1] < ys[j][1]:
                i += 1
            else:
                j += 1
        return total
