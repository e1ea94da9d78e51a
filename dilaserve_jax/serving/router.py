"""Routes each new request to the instance (Engine) with the earliest predicted finish.

The prediction (Engine.predict_finish) combines the instance's published load snapshot (predicted
time left of its running and queued requests), requests submitted but not yet scheduled, and the new
request's own time at τ_max from that instance's latency model and TP degree — so a wide (high-TP)
instance wins at low load and the least-loaded narrow one wins at high load.
"""
from __future__ import annotations

import threading
from typing import Sequence

from dilaserve_jax.serving.engine import Engine, ProgressFn, RequestHandle
from dilaserve_jax.serving.request import Request


class Router:
    def __init__(self, engines: Sequence[Engine]) -> None:
        if not engines:
            raise ValueError("router needs at least one engine")
        names = [e.name for e in engines]
        if len(set(names)) != len(names):
            raise ValueError(f"engine names must be unique: {names}")
        self.engines = list(engines)
        self._where: dict[str, Engine] = {}
        self._lock = threading.Lock()  # one routing decision at a time, so bursts spread out

    def choose(self, request: Request) -> Engine:
        return min(self.engines, key=lambda e: e.predict_finish(request))

    def submit(self, request: Request, on_progress: ProgressFn | None = None) -> RequestHandle:
        with self._lock:
            engine = self.choose(request)
            handle = engine.submit(request, on_progress)
            self._where[request.id] = engine
        handle.future.add_done_callback(lambda _f, rid=request.id: self._forget(rid))
        return handle

    def abort(self, request_id: str) -> bool:
        with self._lock:
            engine = self._where.get(request_id)
        if engine is None:
            return False
        engine.abort(request_id)
        return True

    def instance_of(self, request_id: str) -> str | None:
        with self._lock:
            e = self._where.get(request_id)
        return e.name if e else None

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._where.pop(request_id, None)

    def start(self) -> "Router":
        for e in self.engines:
            e.start()
        return self

    def stop(self) -> None:
        for e in self.engines:
            e.stop()
