"""A cluster: the engines of one layout, a router, and what the frontend needs from them.

The cluster owns the table of requests in flight (serving/cluster/request_table.py; ids are
unique across instances) and moves requests between engines: when an instance fails, the
requests it held — running and waiting — are re-queued on the survivors from their last
committed canvas (their next step is a refresh), and the failed instance is rebuilt on its own
devices when the builder can do that (serving/cluster/recovery.py; meanwhile, with no instance
left, requests are held); only when no instance survives, and none is being rebuilt, do they fail,
with `NoInstanceAvailable` naming the faults. A watchdog thread fails an instance whose runner
call outlives `step_timeout_s`.

Administrative operations — a reshape (serving/cluster/reshape.py) or a weight swap
(serving/cluster/weights_swap.py) — run one at a time: each holds the cluster through
`exclusive()` and changes it only through the `ClusterAdmin` handle it gets (the instance set,
retiring engines, re-routing requests), whose calls take the cluster's locks.

Pure Python over engines: which runners they drive (real jitted decoding, or the fake runner in
tests) is decided by whoever builds the cluster (see serving/executor/build.py for the real one).
"""
from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Sequence

from dilaserve_jax.serving.cluster.admin import ClusterAdmin, ClusterBusy
from dilaserve_jax.serving.cluster.autoscale import Autoscaler
from dilaserve_jax.serving.cluster.builder import InstanceBuilder, InstanceInfo
from dilaserve_jax.serving.cluster.engine import Engine
from dilaserve_jax.serving.cluster.engine_types import EngineUnavailable, Handoff, ProgressFn, RequestHandle
from dilaserve_jax.serving.cluster.protocol import ArrivalObserver
from dilaserve_jax.serving.cluster.recovery import Recovery
from dilaserve_jax.serving.cluster.request_table import DuplicateRequest, RequestTable
from dilaserve_jax.serving.cluster.reshape import ReshapeReport, migrate as move_request, reconfigure as reshape
from dilaserve_jax.serving.cluster.state import NO_CONTROLLER, CheckpointWatchState, ClusterState, InstanceState
from dilaserve_jax.serving.cluster.weights_swap import NewWeights, ReloadReport, swap_weights
from dilaserve_jax.serving.policy.limits import DEFAULT_STEP_TIMEOUT_S
from dilaserve_jax.serving.policy.request import Request
from dilaserve_jax.serving.policy.router import Router, no_instance_reason
from dilaserve_jax.serving.policy.snapshots import EngineSnapshot

__all__ = ["Cluster", "ClusterBusy", "DuplicateRequest", "InstanceInfo"]
log = logging.getLogger(__name__)

Listener = Callable[[str, dict], None]  # (event, details): "failure", "migration", "reload", "reconfigure"
WARMING_UP = "server is still compiling and warming up"


class Cluster:
    def __init__(self, engines: Sequence[Engine], infos: Sequence[InstanceInfo], *, layout: str, policy: str,
                 model_source: str, tokenizer, limits, clock: Callable[[], float] = time.monotonic,
                 loader: Callable[[str, int | None], NewWeights] | None = None,
                 warmup_fn: Callable[["Cluster"], None] | None = None,
                 step_timeout_s: float | None = DEFAULT_STEP_TIMEOUT_S, family: str = "",
                 builder: InstanceBuilder | None = None):
        """`builder`: what reconfigurations build instances with (None: the layout is fixed)."""
        if len(engines) != len(infos):
            raise ValueError("one InstanceInfo per engine")
        names = [e.name for e in engines]
        if len(set(names)) != len(names) or names != [i.name for i in infos]:
            raise ValueError(f"engine names must be unique and match the infos: {names}")
        if step_timeout_s is not None and step_timeout_s <= 0:
            raise ValueError("step_timeout_s must be positive (or None to disable the watchdog)")
        self.engines, self.infos = list(engines), list(infos)  # replaced whole (never mutated) on reshaping
        self.retiring: dict[str, Engine] = {}  # engines a reconfiguration is removing, until they are empty
        self.router = Router()
        self.layout, self.policy, self.model_source, self.family = layout, policy, model_source, family
        self.tokenizer, self.limits, self.clock = tokenizer, limits, clock
        self.step_timeout_s = step_timeout_s
        self._loader, self._warmup_fn = loader, warmup_fn
        self._admin = threading.Lock()  # one reload / reconfiguration at a time (`exclusive`)
        self._requests = RequestTable(self.router, clock, lambda: self.engines, self.engine)
        self._listeners: list[Listener] = []
        self._observers: list[ArrivalObserver] = []
        self._step_hooks: list = []
        self.builder = builder
        self.autoscaler: Autoscaler | None = None  # runs the cluster controller; set by whoever builds the cluster
        self.checkpoint_watch: Callable[[], CheckpointWatchState] | None = None  # a watcher's progress, if any
        self.host_steps: Callable[[], Mapping[str, Any]] | None = None  # other hosts' step metrics, by host
        self.background: list[threading.Thread] = []  # set-up work that stop() waits for
        self.reconfigurations: list[ReshapeReport] = []  # newest last
        self._watchdog: threading.Thread | None = None
        self._stopping = threading.Event()
        self.failures: dict[str, str] = {}  # instance -> fault
        self.migrations: dict[str, int] = {}  # reason -> requests moved
        self.reloads = 0
        self.weight_updates: dict[str, int] = {}  # origin ("reload", "push", "watch") -> swaps
        self.ready = False
        self.recovery = Recovery(self)  # rebuilds a failed instance when the builder can (`enabled` to turn off)
        for e in self.engines:
            e.on_failure = self._on_failure

    # --- lifecycle ---
    def warm_up(self) -> None:
        """Compile and warm every instance on its engine thread (slow; run it off the event loop)."""
        if any(e.state.name == "CREATED" for e in self.engines):
            raise RuntimeError("start the cluster before warming it up (the engines do the work)")
        if self._warmup_fn is not None:
            self._warmup_fn(self)
        self.ready = True

    def start(self) -> "Cluster":
        for e in self.engines:
            e.start()
        if self.step_timeout_s is not None and self._watchdog is None:
            self._stopping.clear()
            self._watchdog = threading.Thread(target=self._watch, name="cluster-watchdog", daemon=True)
            self._watchdog.start()
        return self

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def stop(self, timeout: float | None = 5.0, wait_background: bool = True) -> None:
        """Stop the controller, the engines and the watchdog. Threads in `background` (set-up work
        that must not die mid-compile) are waited for unless `wait_background` is False (a process
        about to exit)."""
        self._stopping.set()
        if self.autoscaler is not None:
            self.autoscaler.stop()
        if wait_background:
            for t in self.background:
                t.join()
        self.recovery.join(timeout)  # a rebuild under way finishes its switch (it starts no new one)
        errors = []
        for e in [*self.engines, *self.retiring.values()]:
            try:
                e.stop(timeout)
            except TimeoutError as err:
                errors.append(err)
        self.release_held()  # nothing will take them now: they fail instead of waiting forever
        if self._watchdog is not None:
            self._watchdog.join(timeout)
            self._watchdog = None
        if errors:
            raise TimeoutError("; ".join(map(str, errors)))

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def add_arrival_observer(self, observer: ArrivalObserver) -> None:
        """`observer(request, now)` on every accepted submission (the controller's load estimate)."""
        self._observers.append(observer)

    def add_step_hook(self, hook) -> None:
        """A step hook on every engine, present and future (reconfigurations build new ones)."""
        self._step_hooks.append(hook)
        for e in self.engines:
            e.add_step_hook(hook)

    def _adopt(self, engines: Sequence[Engine]) -> None:
        for e in engines:
            e.on_failure = self._on_failure
            for hook in self._step_hooks:
                e.add_step_hook(hook)

    # --- requests ---
    def submit(self, request: Request, on_progress: ProgressFn | None = None,
               instance: str | None = None) -> RequestHandle:
        """Place a request (on `instance` while it is healthy, else where the router says)."""
        if not self.ready:
            raise EngineUnavailable(WARMING_UP)
        handle = self._requests.add(request, on_progress, instance)
        now = self.clock()
        for observe in self._observers:
            observe(request, now)
        return handle

    def refusal(self) -> str | None:
        """Why `submit` would refuse a request now, or None when it would take one: refused before
        warm-up ends, and while no instance is up unless a reconfiguration holds arrivals for the
        instances it is bringing up."""
        if not self.ready:
            return WARMING_UP
        if not self.healthy_engines and not self._requests.holding:
            return no_instance_reason(self.snapshots())
        return None

    def abort(self, request_id: str) -> bool:
        return self._requests.abort(request_id)

    def instance_of(self, request_id: str) -> str | None:
        return self._requests.instance_of(request_id)

    def in_flight(self) -> int:
        return len(self._requests)

    def engine(self, name: str) -> Engine:
        for e in self.engines:
            if e.name == name:
                return e
        if name in self.retiring:
            return self.retiring[name]
        raise KeyError(name)

    @property
    def healthy_engines(self) -> list[Engine]:
        return [e for e in self.engines if e.healthy]

    def snapshots(self) -> list[EngineSnapshot]:
        return [e.snapshot() for e in self.engines]

    def compiled_placements(self) -> frozenset[tuple[int, int]]:
        return self.builder.compiled_placements() if self.builder is not None else frozenset()

    # --- moving requests ---
    def requeue(self, handoffs: Sequence[Handoff], reason: str, exclude: frozenset[str] = frozenset(),
                prefer: str | None = None) -> None:
        """Place requests taken off an instance on the others (their next step is a refresh);
        `prefer`: the instance to place them on while it is healthy (a migration's target)."""
        self._requests.place_again(handoffs, exclude, prefer)
        if handoffs:
            self.migrations[reason] = self.migrations.get(reason, 0) + len(handoffs)
            self._emit("migration", {"reason": reason, "count": len(handoffs)})

    def _on_failure(self, engine: Engine, handoffs: list[Handoff], error: BaseException) -> None:
        fault = f"{type(error).__name__}: {error}"
        self.failures[engine.name] = fault
        log.error("instance %s failed (%s); re-queueing %d request(s) on the survivors", engine.name, fault,
                  len(handoffs))
        self._emit("failure", {"instance": engine.name, "error": fault})
        rebuild = self.recovery.wanted(engine.name, error)
        hold = rebuild and not self.healthy_engines
        if hold:  # the rebuilt instance will take them
            self.hold_arrivals()
        self.requeue(handoffs, "failure", exclude=frozenset({engine.name}))
        if rebuild:
            self.recovery.start(engine.name, hold)

    def hold_arrivals(self) -> None:
        """Hold requests no instance can take (instead of failing them) until `release_held`."""
        self._requests.holding = True

    def release_held(self) -> None:
        """Stop holding; place what was held (with no instance up, each fails naming the faults)."""
        self._requests.holding = False
        self._requests.place_held()

    def _watch(self) -> None:
        limit = self.step_timeout_s
        period = min(1.0, limit / 4)
        while not self._stopping.wait(period):
            for e in [*self.engines, *self.retiring.values()]:
                e.check_hung(limit)

    def _emit(self, event: str, details: dict) -> None:
        for listener in list(self._listeners):
            try:
                listener(event, details)
            except Exception:  # noqa: BLE001 - an observer must not break serving
                log.exception("cluster listener failed on %s", event)

    # --- administration ---
    @contextmanager
    def exclusive(self, what: str, wait_s: float | None = None) -> Iterator[ClusterAdmin]:
        """Hold the cluster for one administrative operation (`what`: "reload", "reconfiguration");
        waits up to `wait_s` for one under way (None: not at all), else raises ClusterBusy."""
        got = self._admin.acquire(blocking=False) if wait_s is None else self._admin.acquire(timeout=wait_s)
        if not got:
            raise ClusterBusy(f"cannot start a {what}: another reload or reconfiguration is in progress")
        admin = _Admin(self)
        try:
            yield admin
        finally:
            admin.held = False
            self._admin.release()

    def reload(self, source: str, step: int | None = None, timeout: float | None = 600.0,
               origin: str = "reload") -> ReloadReport:
        """Load new weights and swap them into every serving instance between two of its steps.

        Requests in flight keep running: each one's remaining steps use the new weights, starting
        with a refresh (its cached K/V came from the old ones). Raises ClusterBusy if another
        reload or reconfiguration is under way; the loader's errors pass through unchanged (the
        old weights keep serving)."""
        if self._loader is None:
            raise ValueError("this cluster cannot reload weights")
        return swap_weights(self, lambda: self._loader(source, step), timeout, None, origin)

    def swap_in(self, new: NewWeights | Callable[[], NewWeights], timeout: float | None = 600.0,
                wait_s: float | None = None, origin: str = "push") -> ReloadReport:
        """Swap weights already placed on every instance's devices (e.g. pushed in memory by a
        training job) in, exactly as `reload` does after loading. `new` may be a function giving them,
        called while no reload or reconfiguration can start. `wait_s`: how long to wait for one under
        way (None: raise ClusterBusy at once)."""
        return swap_weights(self, new if callable(new) else lambda: new, timeout, wait_s, origin)

    def reconfigure(self, spec: str, reason: str = "manual") -> ReshapeReport:
        """Reshape the devices into the layout `spec` while serving (see serving/cluster/reshape.py)."""
        return reshape(self, spec, reason)

    def migrate(self, request_id: str, target: str, reason: str = "rebalance", timeout: float = 60.0) -> bool:
        """Move one request to instance `target` at its next step boundary (False if it is gone)."""
        return move_request(self, request_id, target, reason, timeout)

    def state(self) -> ClusterState:
        instances = tuple(InstanceState.of(info, e.snapshot()) for e, info in zip(self.engines, self.infos))
        scaler, watch = self.autoscaler, self.checkpoint_watch
        return ClusterState(self.layout, self.policy, self.model_source, self.family, instances,
                            dict(self.failures), dict(self.migrations), self.reloads, self.in_flight(),
                            dict(self.weight_updates), scaler.state() if scaler is not None else NO_CONTROLLER,
                            tuple(str(r) for r in self.reconfigurations[-8:]), watch() if watch is not None else None)


class _Admin:
    """The `ClusterAdmin` an exclusive operation is handed; it refuses use once the hold ends."""

    def __init__(self, cluster: Cluster) -> None:
        self._cluster, self.held = cluster, True
        self.clock = cluster.clock

    @property
    def _c(self) -> Cluster:
        if not self.held:
            raise RuntimeError("this administrative operation no longer holds the cluster")
        return self._cluster

    @property
    def layout(self) -> str:
        return self._c.layout

    @property
    def engines(self) -> list[Engine]:
        return list(self._c.engines)

    @property
    def healthy_engines(self) -> list[Engine]:
        return self._c.healthy_engines

    def adopt(self, engines: Sequence[Engine]) -> None:
        self._c._adopt(engines)

    def retire(self, engines: Sequence[Engine]) -> None:
        c, names = self._c, {e.name for e in engines}
        c.hold_arrivals()  # requests no instance can take are held until `install`
        with c._requests.lock:
            c.engines = [e for e in c.engines if e.name not in names]
            c.retiring.update({e.name: e for e in engines})

    def install(self, engines: Sequence[Engine], infos: Sequence[InstanceInfo], layout: str) -> None:
        c, names = self._c, {e.name for e in engines}
        with c._requests.lock:  # one step: a request placed meanwhile sees the old set or the new one
            c.retiring.update({e.name: e for e in c.engines if e.name not in names})
            c.engines, c.infos, c.layout = list(engines), list(infos), layout
        c.release_held()

    def requeue(self, handoffs: Sequence[Handoff], reason: str, exclude: frozenset[str] = frozenset()) -> None:
        self._c.requeue(handoffs, reason, exclude)

    def forget(self, names: Sequence[str]) -> None:
        c = self._c
        for name in names:
            c.retiring.pop(name, None)

    def record_reconfiguration(self, report: ReshapeReport) -> None:
        c = self._c
        c.reconfigurations.append(report)
        del c.reconfigurations[:-32]

    def weights_swapped(self, source: str, origin: str) -> None:
        c = self._c
        c.model_source = source
        c.reloads += 1
        c.weight_updates[origin] = c.weight_updates.get(origin, 0) + 1

    def emit(self, event: str, details: dict) -> None:
        self._c._emit(event, details)
