"""A cluster: the engines of one layout behind a router, plus the operations the frontend needs.

Pure Python over engines: which runners the engines drive (real jitted decoding, or the fake runner
in tests) is decided by whoever builds the cluster (see serving/build.py for the real one).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from dilaserve_jax.serving.engine import Engine, ProgressFn, RequestHandle
from dilaserve_jax.serving.request import Request
from dilaserve_jax.serving.router import Router


@dataclass(frozen=True, slots=True)
class InstanceInfo:
    name: str
    tp_degree: int
    device_ids: tuple[int, ...]


class Cluster:
    def __init__(self, engines: Sequence[Engine], infos: Sequence[InstanceInfo], *, layout: str, policy: str,
                 model_source: str, tokenizer, limits, clock: Callable[[], float] = time.monotonic,
                 reload_fn: Callable[[str, int | None], str] | None = None,
                 warmup_fn: Callable[[], None] | None = None, model_family: str = ""):
        if len(engines) != len(infos):
            raise ValueError("one InstanceInfo per engine")
        self.engines, self.infos = list(engines), list(infos)
        self.router = Router(self.engines)
        self.layout, self.policy, self.model_source = layout, policy, model_source
        self.model_family = model_family  # "llada" or "dream"; a reload must keep the architecture, hence it
        self.tokenizer, self.limits, self.clock = tokenizer, limits, clock
        self._reload_fn, self._warmup_fn = reload_fn, warmup_fn
        self._reload_lock = threading.Lock()
        self.ready = False

    def warm_up(self) -> None:
        """Compile and warm every instance (slow; run it off the event loop)."""
        if self._warmup_fn is not None:
            self._warmup_fn()
        self.ready = True

    def start(self) -> "Cluster":
        self.router.start()
        return self

    def stop(self) -> None:
        self.router.stop()

    def submit(self, request: Request, on_progress: ProgressFn | None = None) -> RequestHandle:
        if not self.ready:
            raise RuntimeError("server is still compiling and warming up")
        return self.router.submit(request, on_progress)

    def abort(self, request_id: str) -> bool:
        return self.router.abort(request_id)

    def state(self) -> dict:
        instances = []
        for engine, info in zip(self.engines, self.infos):
            snap = engine.snapshot()
            instances.append({"name": info.name, "tp_degree": info.tp_degree, "device_ids": list(info.device_ids),
                              "slots": snap.num_slots, "running": len(snap.running_left),
                              "waiting": len(snap.waiting_left), "steps_done": engine.steps})
        return {"layout": self.layout, "policy": self.policy, "model": self.model_source,
                "model_family": self.model_family, "instances": instances}

    def reload(self, source: str, step: int | None = None) -> tuple[str, float]:
        """Swap in new weights between steps; requests in flight keep running."""
        if self._reload_fn is None:
            raise ValueError("this cluster cannot reload weights")
        with self._reload_lock:
            t0 = time.perf_counter()
            self.model_source = self._reload_fn(source, step)
            return self.model_source, time.perf_counter() - t0
