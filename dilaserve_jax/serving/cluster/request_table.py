"""The requests in flight across a cluster's instances: where each one is, and placing it.

Ids are unique across instances. A new request goes where the router says (or to the instance
asked for, while it is healthy); one taken off an instance (failure, migration, reshape) is placed
again with its caller's future, so its stream and result carry on. While a layout switch leaves no
instance to take one, it is held and placed once the new instances serve. One lock guards the
table and every placement; the cluster takes it too when it replaces its serving set, so a
placement sees either the old set or the new one.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Callable, Sequence

from dilaserve_jax.serving.cluster.engine import Engine
from dilaserve_jax.serving.cluster.engine_types import (EngineUnavailable, Handoff, ProgressFn, RequestHandle,
                                                        RequestResult, fail_future, resolve_future)
from dilaserve_jax.serving.policy.request import Request, RequestState
from dilaserve_jax.serving.policy.router import NoInstanceAvailable, Router


class DuplicateRequest(ValueError):
    """A request with this id is already in flight somewhere in the cluster."""


class RequestTable:
    def __init__(self, router: Router, clock: Callable[[], float], serving: Callable[[], Sequence[Engine]],
                 engine: Callable[[str], Engine]) -> None:
        """`serving()`: the engines new requests may go to; `engine(name)`: any, retiring ones too."""
        self.router, self.clock, self._serving, self._engine = router, clock, serving, engine
        self.lock = threading.Lock()
        self.holding = False  # a layout switch is under way: hold what no instance can take
        self._where: dict[str, str] = {}  # request id -> its instance ("" while held)
        self._abort_wanted: set[str] = set()
        self._held: list[Handoff] = []

    # --- requests ---
    def add(self, request: Request, on_progress: ProgressFn | None = None,
            instance: str | None = None) -> RequestHandle:
        """Place a new request (on `instance` while it is healthy, else where the router says)."""
        fut: Future = Future()
        with self.lock:
            if request.id in self._where:
                raise DuplicateRequest(f"request id {request.id!r} is already in flight")
            self._where[request.id] = ""
            try:
                self._place_locked(Handoff(request, fut, on_progress), prefer=instance)
            except BaseException:
                del self._where[request.id]
                raise
        fut.add_done_callback(lambda _f, rid=request.id: self._forget(rid))
        return RequestHandle(request.id, fut, lambda: self.instance_of(request.id) or "",
                             lambda: self.abort(request.id))

    def abort(self, request_id: str) -> bool:
        with self.lock:
            where = self._where.get(request_id)
            if where is None:
                return False
            self._abort_wanted.add(request_id)
            if not where:  # held during a reconfiguration: dropped when placed
                return True
            engine = self._engine(where)
        engine.abort(request_id)
        return True

    def instance_of(self, request_id: str) -> str | None:
        with self.lock:
            return self._where.get(request_id)

    def __len__(self) -> int:
        with self.lock:
            return len(self._where)

    # --- moving requests ---
    def place_again(self, handoffs: Sequence[Handoff], exclude: frozenset[str] = frozenset(),
                    prefer: str | None = None) -> None:
        """Place requests taken off an instance on the others (their next step is a refresh);
        `prefer`: the instance to place them on while it is healthy (a migration's target)."""
        self._place_all(handoffs, exclude, prefer)

    def place_held(self) -> None:
        """Place the requests held while no instance was up (end of a reconfiguration)."""
        with self.lock:
            held, self._held = self._held, []
        self._place_all(held)

    def _place_all(self, handoffs: Sequence[Handoff], exclude: frozenset[str] = frozenset(),
                   prefer: str | None = None) -> None:
        """Place requests again; an abort asked for meanwhile ends the request instead. Futures
        are resolved outside the lock: their callbacks take it."""
        settled: list[tuple[Future, Any]] = []
        with self.lock:
            for h in handoffs:
                if h.request.id not in self._where:  # resolved meanwhile
                    continue
                if h.request.id in self._abort_wanted:
                    h.request.transition(RequestState.FINISHED_ABORTED, self.clock())
                    settled.append((h.future, RequestResult.of(h.request, self._where[h.request.id])))
                    continue
                try:
                    self._place_locked(h, exclude, prefer)
                except NoInstanceAvailable as err:
                    settled.append((h.future, err))
        for fut, outcome in settled:
            if isinstance(outcome, BaseException):
                fail_future(fut, outcome)
            else:
                resolve_future(fut, outcome)

    def _place_locked(self, h: Handoff, exclude: frozenset[str] = frozenset(), prefer: str | None = None) -> None:
        tried = set(exclude)
        while True:
            snaps = [e.snapshot() for e in self._serving()]
            own = None  # the router's estimate of its time there, passed on so it is made once
            if prefer is not None and prefer not in tried and any(s.name == prefer and s.healthy for s in snaps):
                name = prefer
            else:
                try:
                    placed = self.router.place(snaps, h.request, self.clock(), frozenset(tried))
                    name, own = placed.instance, placed.own_seconds
                except NoInstanceAvailable:
                    if self.holding:  # instances are coming up: hold it until they are
                        self._held.append(h)
                        self._where[h.request.id] = ""
                        return
                    raise
            try:
                self._engine(name).submit(h.request, h.on_progress, future=h.future, speed_ratio=h.speed_ratio,
                                          own_seconds=own)
            except EngineUnavailable:  # it failed since its snapshot: try the others
                tried.add(name)
                continue
            self._where[h.request.id] = name
            return

    def _forget(self, request_id: str) -> None:
        with self.lock:
            self._where.pop(request_id, None)
            self._abort_wanted.discard(request_id)
