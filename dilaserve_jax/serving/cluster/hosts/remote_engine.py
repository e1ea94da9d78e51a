"""The leader's stand-in for an engine on another host: the interface the cluster uses of a local
`Engine` (submit, abort, hand_over, snapshot, state, fail), carried over a `HostLink`.

It keeps a copy of every request it was given, brought up to date by the worker's step reports
(host state, step records, committed tokens; every step for a streaming caller, else every block). That copy is what moves: a hand-over returns the
worker's own, fresher state; when the host is lost, the copies go to the survivors as they stood
at the last report, and their next step there is a refresh. So routing, migration, re-queueing
and reconfiguration run the cluster's own code over local and remote engines alike.

A weight swap is an operation like the others: the host swaps the weights its worker loaded for
this instance (see hosts_weights.py) and reports when. Not carried: `call` (it runs a function on
the engine thread, which is in another process) and step hooks (the step plans stay on the host;
the worker counts the step metrics there, see step_tally.py).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Sequence

from dilaserve_jax.serving.cluster.engine_types import (EngineUnavailable, FailureFn, Handoff, ProgressFn,
                                                        RequestHandle, RequestResult, StepHook, describe_error,
                                                        fail_future, resolve_future)
from dilaserve_jax.serving.cluster.hosts.worker import HOST_STATE_FIELDS
from dilaserve_jax.serving.policy.request import Request
from dilaserve_jax.serving.policy.snapshots import EngineSnapshot, EngineState, own_time

log = logging.getLogger(__name__)
_tokens = itertools.count()


class HostLost(RuntimeError):
    """The worker process of a host died or cannot be reached."""


class RemoteEngine:
    def __init__(self, link, local_name: str, name: str, first: EngineSnapshot) -> None:
        """`link`: the host's `HostLink` (`send(op) -> sequence number`); `local_name`: the engine's
        name on its host; `name`: the name the cluster knows it by (unique across hosts)."""
        self.link, self.local_name, self.name = link, local_name, name
        self.on_failure: FailureFn | None = None
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._state = EngineState.CREATED
        self._copies: dict[str, tuple[Request, Future, ProgressFn | None]] = {}
        self._pending: dict[str, tuple[float, int]] = {}  # sent, not yet in a host snapshot: (seconds, seq)
        self._handovers: dict[int, Future] = {}
        self._swaps: dict[int, Future] = {}
        self._remote = dataclasses.replace(first, name=name)

    # --- the Engine interface the cluster uses ---
    def submit(self, request: Request, on_progress: ProgressFn | None = None, future: Future | None = None,
               speed_ratio: float | None = None, own_seconds: float | None = None) -> RequestHandle:
        fut = future if future is not None else Future()
        work = own_time(self.snapshot().load, request) if own_seconds is None else own_seconds
        with self._lock:
            if self._state in (EngineState.STOPPED, EngineState.FAILED):
                raise EngineUnavailable(f"instance {self.name} is {self._state.name.lower()}", self.error)
            if request.id in self._copies:
                raise ValueError(f"duplicate request id {request.id!r}")
            self._copies[request.id] = (request, fut, on_progress)
            seq = self.link.send(("add", self.local_name, request, speed_ratio, work, on_progress is not None))
            self._pending[request.id] = (work, seq)
        return RequestHandle(request.id, fut, lambda: self.name, lambda: self.abort(request.id))

    def abort(self, request_id: str) -> None:
        self.link.send(("abort", self.local_name, request_id))

    def hand_over(self, request_ids: Sequence[str] | None = None) -> Future:
        fut: Future = Future()
        token = next(_tokens)
        with self._lock:
            if self._state == EngineState.FAILED:
                fut.set_exception(EngineUnavailable(f"instance {self.name} failed", self.error))
                return fut
            ids = tuple(self._copies) if request_ids is None else tuple(request_ids)
            self._handovers[token] = fut
        self.link.send(("hand_over", self.local_name, ids, token))
        return fut

    def call(self, fn: Callable[[], Any]) -> Future:
        fut: Future = Future()
        fut.set_exception(EngineUnavailable(f"instance {self.name} runs on another host: no calls on its thread"))
        return fut

    def swap_weights(self, params=None) -> Future:
        """Swap in the weights the host's worker loaded for this instance (`params`: only a label
        here; the arrays stay on the host). The result is the swap's clock time."""
        fut: Future = Future()
        token = next(_tokens)
        with self._lock:
            if self._state in (EngineState.STOPPED, EngineState.FAILED):
                fut.set_exception(EngineUnavailable(f"instance {self.name} is {self._state.name.lower()}", self.error))
                return fut
            self._swaps[token] = fut
        self.link.send(("swap", self.local_name, token))
        return fut

    def set_latency_model(self, latency) -> Future:
        return self.call(lambda: None)

    def add_step_hook(self, hook: StepHook) -> None:
        pass  # the step plans stay on the host (see the module doc)

    def remove_step_hook(self, hook: StepHook) -> None:
        pass

    def snapshot(self) -> EngineSnapshot:
        with self._lock:
            snap, state = self._remote, self._state
            pending = tuple(w for w, _ in self._pending.values())
        if state in (EngineState.FAILED, EngineState.STOPPED):
            return dataclasses.replace(snap, state=state, pending=(),
                                       error=None if self.error is None else describe_error(self.error))
        return dataclasses.replace(snap, state=state, pending=tuple(snap.pending) + pending)

    @property
    def state(self) -> EngineState:
        with self._lock:
            return self._state

    @property
    def healthy(self) -> bool:
        return self.state in (EngineState.CREATED, EngineState.RUNNING)

    @property
    def steps(self) -> int:
        return self._remote.steps

    def start(self) -> "RemoteEngine":
        with self._lock:
            if self._state == EngineState.CREATED:
                self._state = EngineState.RUNNING
        return self

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop taking work; requests still here fail with EngineUnavailable (drain first)."""
        with self._lock:
            if self._state != EngineState.FAILED:
                self._state = EngineState.STOPPED
            copies, self._copies = self._copies, {}
            self._pending.clear()
            swaps, self._swaps = self._swaps, {}
        for fut in [*(f for _, f, _ in copies.values()), *swaps.values()]:
            fail_future(fut, EngineUnavailable(f"instance {self.name} stopped"))

    def check_hung(self, limit_s: float, now: float | None = None) -> bool:
        return False  # the host's own watchdog watches its runner calls

    def fail(self, error: BaseException, fresher: Sequence[tuple[Request, float | None]] = ()) -> bool:
        """Mark the instance failed and hand every request it held to `on_failure`: from the worker's
        own state where it sent it (`fresher`), else from the last step report."""
        with self._lock:
            if self._state in (EngineState.FAILED, EngineState.STOPPED):
                return False
            self._state, self.error = EngineState.FAILED, error
            copies, self._copies = self._copies, {}
            self._pending.clear()
            waiters, self._handovers = self._handovers, {}
            waiters.update(self._swaps)
            self._swaps = {}
        for w in waiters.values():
            fail_future(w, EngineUnavailable(f"instance {self.name} failed", error))
        ratios = {}
        for req, ratio in fresher:
            if req.id in copies:
                _adopt(copies[req.id][0], req)
                ratios[req.id] = ratio
        now = time.monotonic()
        handoffs = []
        for req, fut, cb in copies.values():
            if fut.done() or req.finished:
                continue
            if req.id not in ratios:  # as of its last report: it moves with that canvas, next step a refresh
                req.detach(now)
            handoffs.append(Handoff(req, fut, cb, ratios.get(req.id)))
        log.error("instance %s failed (%s): %d request(s) to move", self.name, describe_error(error), len(handoffs))
        if self.on_failure is not None:
            self.on_failure(self, handoffs, error)
        else:
            for h in handoffs:
                fail_future(h.future, EngineUnavailable(f"instance {self.name} failed: {error}", error))
        return True

    # --- reports from the host (the link's poller thread, in the order the host made them) ---
    def reported(self, report: tuple) -> None:
        kind = report[0]
        if kind == "step":
            _, _, rid, state, records, positions, tokens, progress = report
            with self._lock:
                entry = self._copies.get(rid)
                self._pending.pop(rid, None)
            if entry is None:
                return
            req, _, cb = entry
            for f, v in zip(HOST_STATE_FIELDS, state):
                setattr(req, f, v)
            req.steps.extend(records)
            for p, t in zip(positions, tokens):
                if 0 <= p < req.answer_length:
                    req.answer[p] = int(t)
            if cb is not None and progress is not None:
                try:
                    cb(dataclasses.replace(progress, instance=self.name))
                except Exception:  # a caller's callback must not stop the host's reports
                    log.exception("progress callback for %s failed", rid)
        elif kind == "done":
            _, _, rid, result = report
            with self._lock:
                entry = self._copies.pop(rid, None)
                self._pending.pop(rid, None)
            if entry is not None:
                _finish(entry[0], result)
                resolve_future(entry[1], dataclasses.replace(result, instance=self.name))
        elif kind == "handed":
            _, _, token, items = report
            with self._lock:
                waiter = self._handovers.pop(token, None)
                handoffs = []
                for req, ratio in items:
                    entry = self._copies.pop(req.id, None)
                    self._pending.pop(req.id, None)
                    if entry is not None:
                        _adopt(entry[0], req)
                        handoffs.append(Handoff(entry[0], entry[1], entry[2], ratio))
            if waiter is not None:
                resolve_future(waiter, handoffs)
        elif kind == "failed":
            _, _, fault, items = report
            self.fail(RuntimeError(f"on host {self.link.host}: {fault}"), items)
        elif kind == "swapped":
            _, _, token, at, fault = report
            with self._lock:
                fut = self._swaps.pop(token, None)
            if fut is None:
                return
            if fault is None:
                resolve_future(fut, at)
            elif fault == "unavailable":
                fail_future(fut, EngineUnavailable(f"instance {self.name} failed or stopped during a weight swap"))
            else:
                fail_future(fut, RuntimeError(f"weight swap on host {self.link.host}: {fault}"))

    def host_snapshot(self, snap: EngineSnapshot, acked_seq: int) -> None:
        """The host's snapshot, taken after it had applied operations up to `acked_seq`."""
        with self._lock:
            self._remote = dataclasses.replace(snap, name=self.name)
            for rid in [r for r, (_, seq) in self._pending.items() if seq <= acked_seq]:
                del self._pending[rid]
            if snap.state == EngineState.FAILED and self.error is None:
                self.error = RuntimeError(snap.error or "failed on its host")


def _adopt(copy: Request, fresher: Request) -> None:
    """Bring the leader's copy to the host's state (the caller holds the copy, not the host's)."""
    for f in dataclasses.fields(Request):
        setattr(copy, f.name, getattr(fresher, f.name))


def _finish(copy: Request, result: RequestResult) -> None:
    if not copy.finished:
        copy.state, copy.finish_time = result.state, result.finish
        copy.output_tokens = list(result.tokens)
