"""The simulated cluster: instances on virtual clocks, placement, and a non-blocking actuator.

It implements the `ServingCluster` protocol (serving/cluster/protocol.py) as the threaded
`Cluster` does — snapshots, infos, `engine(name)`, compiled placements, `submit`, `abort`,
`reconfigure`, `migrate`, arrival observers, `state()` — so the control round
(`Autoscaler.round`) runs unchanged on virtual time. Differences from the threaded cluster, all
forced by having no threads:

- An instance's engine is stepped by the simulator (`Engine.step_once`), which runs a whole step at
  once and moves the instance's clock to its end. While the step is "in flight" the rest of the
  cluster sees what a real engine would publish meanwhile: its snapshot from before the step, plus
  the work submitted since (`SimInstance.snapshot`).
- `reconfigure` returns at once: the switch completes after its modelled cost (weights that must
  arrive on devices, `core.layouts.moved_fraction`, at the interconnect bandwidth, plus compile time
  for placements never seen), while the old instances keep serving (the real actuator's overlap
  mode). Then the new instances start, new requests go to them, each removed instance hands over
  its requests at its next step boundary and they are re-admitted where the router places them
  (their next step is a refresh, charged like any step).
- `migrate` posts the hand-over and returns; the request moves at its source's next step boundary.
- `submit` places a request at the cluster's current virtual time (`now`).
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Sequence

from dilaserve_jax.core.layouts import (every_placement, instance_name, layout_text, moved_fraction, parse_layout,
                                        placements, received_per_device)
from dilaserve_jax.serving.cluster.admin import ClusterBusy
from dilaserve_jax.serving.cluster.autoscale import Autoscaler
from dilaserve_jax.serving.cluster.builder import InstanceInfo
from dilaserve_jax.serving.cluster.engine import Engine
from dilaserve_jax.serving.cluster.engine_types import Handoff, ProgressFn, RequestHandle
from dilaserve_jax.serving.cluster.protocol import ArrivalObserver
from dilaserve_jax.serving.cluster.state import NO_CONTROLLER, ClusterState, InstanceState
from dilaserve_jax.serving.policy.snapshots import EngineSnapshot, own_time
from dilaserve_jax.serving.policy.request import Request
from dilaserve_jax.serving.policy.router import NoInstanceAvailable, Router
from dilaserve_jax.sim.executor import VirtualClock

# event priorities at equal times: arrivals first (a real engine's next iteration sees what arrived
# during its step), then switches, control rounds, and instance iterations
ARRIVAL, SWITCH, CONTROL, STEP = 0, 1, 2, 3


def instance_infos(spec: str | Sequence[int], num_devices: int) -> list[InstanceInfo]:
    """The instances of a layout, named as the real builder names them (TP degree and devices)."""
    layout = parse_layout(spec) if isinstance(spec, str) else tuple(sorted(spec, reverse=True))
    if sum(layout) != num_devices:
        raise ValueError(f"layout {layout_text(layout)} covers {sum(layout)} devices, the cluster has {num_devices}")
    out = []
    for tp, first in placements(layout):
        ids = tuple(range(first, first + tp))
        out.append(InstanceInfo(instance_name(ids), tp, ids))
    return out


class SimInstance:
    """One instance: a real Engine over a modelled runner, on its own virtual clock."""

    def __init__(self, info: InstanceInfo, engine: Engine, clock: VirtualClock) -> None:
        self.info, self.engine, self.clock = info, engine, clock
        self.name = info.name
        self.visible: EngineSnapshot = engine.snapshot()
        self.pending_work: list[float] = []  # submitted since its last iteration began
        self.busy_until: float | None = None  # end of the step in flight
        self.scheduled = False  # an iteration event is queued

    @property
    def healthy(self) -> bool:
        return self.engine.healthy

    def snapshot(self) -> EngineSnapshot:
        """What other code may see now: the snapshot published before the step in flight."""
        if not self.pending_work:
            return self.visible
        return dataclasses.replace(self.visible, pending=tuple(self.pending_work))


@dataclass
class SwitchReport:
    old: str
    new: str
    reason: str
    started: float
    finished: float | None = None
    switch_s: float = 0.0
    bytes_moved: float = 0.0
    compiled: int = 0
    kept: tuple[str, ...] = ()
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    requests_moved: int = 0

    def __str__(self) -> str:
        return (f"{self.old} -> {self.new} ({self.reason}) at {self.started:.1f} s: {self.switch_s:.2f} s to switch, "
                f"{self.bytes_moved / 2**30:.2f} GiB moved, {self.compiled} placements compiled, "
                f"{self.requests_moved} requests moved")


class SimBuilder:
    """The placements compiled so far (the real builder's executable cache, for the controller).
    `by_degree` models a GPU with the persistent compile cache, as `serve` runs by default: JAX
    leaves the device assignment out of a GPU executable's cache key, so once a TP degree is
    compiled on any devices, every placement of it loads from the cache instead of compiling."""

    def __init__(self, num_devices: int = 0, by_degree: bool = False) -> None:
        self.num_devices, self.by_degree = num_devices, by_degree
        self.compiled: set[tuple[int, int]] = set()

    def compiled_placements(self) -> frozenset[tuple[int, int]]:
        if not self.by_degree:
            return frozenset(self.compiled)
        return every_placement({tp for tp, _ in self.compiled}, self.num_devices)


@dataclass(frozen=True, slots=True)
class SwitchCost:
    param_bytes: float  # one full copy of the weights
    bandwidth_gbps: float = 100.0  # GB/s into each device
    compile_s: float = 10.0  # per new placement never compiled
    load_s: float = 0.0  # per new instance: build and warm it (its executables compiled or loaded)

    def seconds(self, old: Sequence[int], new: Sequence[int], compiled: frozenset[tuple[int, int]]) -> tuple[float, float, int]:
        """(seconds until the new layout serves, bytes moved, placements compiled)."""
        moved = moved_fraction(old, new) * self.param_bytes
        per_device = max(received_per_device(old, new), default=0.0) * self.param_bytes
        kept = placements(old)
        added = [p for p in placements(new) if p not in kept]
        unseen = sum(p not in compiled for p in added)
        build = self.load_s * len(added) + self.compile_s * unseen
        return per_device / (self.bandwidth_gbps * 1e9) + build, moved, unseen


class SimCluster:
    """Instances of one layout at a time, a router, the request table, and the actuator."""

    def __init__(self, num_devices: int, layout: str, make_instance: Callable[[InstanceInfo, float], SimInstance],
                 cost: SwitchCost | None = None, *, policy: str = "", model: str = "",
                 compiled_degrees: Sequence[int] = (), compile_by_degree: bool = False) -> None:
        """`policy`, `model`: labels for `state()`; `compiled_degrees`: TP degrees compiled before
        serving (the server measures every degree the controller may choose before `ready:`);
        `compile_by_degree`: see `SimBuilder`."""
        self.num_devices, self.policy, self.model = num_devices, policy, model
        self.make_instance = make_instance
        self.cost = cost or SwitchCost(param_bytes=0.0)
        self.router = Router()
        self.builder = SimBuilder(num_devices, compile_by_degree)
        self.infos = instance_infos(layout, num_devices)
        self.builder.compiled.update((tp, 0) for tp in compiled_degrees)
        self.engines: list[SimInstance] = [make_instance(i, 0.0) for i in self.infos]
        self.layout = layout_text([i.tp_degree for i in self.infos])
        self.builder.compiled.update(placements([i.tp_degree for i in self.infos]))
        self.retiring: dict[str, SimInstance] = {}
        self.ready = True
        self.switching = False
        self.autoscaler: Autoscaler | None = None  # its controller is told when a switch completes
        self.reconfigurations: list[SwitchReport] = []
        self.migrations: dict[str, int] = {}
        self.where: dict[str, str] = {}  # request id -> instance
        self.now = 0.0
        self._observers: list[ArrivalObserver] = []
        self._events: list = []
        self._seq = itertools.count()
        self._actions: list[Callable[[], None]] = []  # work for after the current engine iteration

    # --- events ---
    def push(self, t: float, prio: int, what, payload=None) -> None:
        heapq.heappush(self._events, (t, prio, next(self._seq), what, payload))

    def has_events(self, other_than: int | None = None) -> bool:
        """Whether any event (of a priority other than `other_than`) is still to come."""
        return any(e[1] != other_than for e in self._events)

    def wake(self, inst: SimInstance, t: float) -> None:
        """Make an idle instance iterate at t (a busy one does at the end of its step)."""
        if not inst.scheduled and inst.busy_until is None:
            inst.scheduled = True
            self.push(t, STEP, inst)

    def iterate(self, inst: SimInstance, t: float) -> None:
        """One engine iteration of `inst` at virtual time t (its STEP event)."""
        inst.scheduled = False
        inst.clock.set(t)
        inst.visible = dataclasses.replace(inst.engine.snapshot(), pending=())
        inst.pending_work.clear()
        progressed = inst.engine.step_once()
        t_end = inst.clock()
        self.run_actions()
        if progressed:
            inst.busy_until = t_end if t_end > t else None
            inst.scheduled = True
            self.push(t_end, STEP, inst)
        else:
            inst.busy_until = None
            inst.visible = inst.engine.snapshot()

    def process_next(self, handlers: dict) -> tuple[float, int] | None:
        """Pop the next event and run it: STEP and SWITCH here, the others by `handlers[prio](t, what,
        payload)`; then the follow-up work its engine iteration left. None when no event is left."""
        if not self._events:
            return None
        t, prio, _, what, payload = heapq.heappop(self._events)
        self.now = t
        if prio == STEP:
            self.iterate(what, t)
        elif prio == SWITCH:
            what(t, payload)
        else:
            handlers[prio](t, what, payload)
        self.run_actions()
        return t, prio

    def run_actions(self) -> None:
        while self._actions:
            self._actions.pop(0)()

    # --- the ServingCluster protocol ---
    def add_arrival_observer(self, observer: ArrivalObserver) -> None:
        self._observers.append(observer)

    def snapshots(self) -> list[EngineSnapshot]:
        return [e.snapshot() for e in self.engines]

    def compiled_placements(self) -> frozenset[tuple[int, int]]:
        return self.builder.compiled_placements()

    def engine(self, name: str) -> SimInstance:
        for e in self.engines:
            if e.name == name:
                return e
        if name in self.retiring:
            return self.retiring[name]
        raise KeyError(name)

    def instance_of(self, request_id: str) -> str | None:
        return self.where.get(request_id)

    def submit(self, request: Request, on_progress: ProgressFn | None = None,
               instance: str | None = None) -> RequestHandle:
        """Place a new request now (on `instance` while it is healthy, else the router's choice)."""
        t, rid, fut = self.now, request.id, Future()
        self._place(request, fut, None, t, prefer=instance, on_progress=on_progress)
        fut.add_done_callback(lambda _f: self.where.pop(rid, None))
        for observe in self._observers:
            observe(request, t)
        return RequestHandle(rid, fut, lambda: self.where.get(rid, ""), lambda: self.abort(rid))

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its instance applies it at its next iteration."""
        name = self.where.get(request_id)
        if name is None:
            return False
        inst = self.engine(name)
        inst.engine.abort(request_id)
        self.wake(inst, self.now)
        return True

    def state(self) -> ClusterState:
        instances = tuple(InstanceState.of(e.info, e.snapshot()) for e in self.engines)
        scaler = self.autoscaler
        failures = {i.name: i.error for i in instances if i.state == "failed"}
        return ClusterState(self.layout, self.policy, self.model, "", instances, failures, dict(self.migrations),
                            in_flight=len(self.where),
                            controller=scaler.state() if scaler is not None else NO_CONTROLLER,
                            reconfigurations=tuple(str(r) for r in self.reconfigurations[-8:]))

    def _place(self, req: Request, future: Future, ratio: float | None, t: float,
               exclude: frozenset[str] = frozenset(), prefer: str | None = None,
               on_progress: ProgressFn | None = None) -> str:
        healthy = [e for e in self.engines if e.healthy and e.name not in exclude]
        if not healthy:
            raise NoInstanceAvailable("no instance is serving")
        if prefer is not None and any(e.name == prefer for e in healthy):
            inst = next(e for e in healthy if e.name == prefer)
            own = own_time(inst.visible.load, req)
        else:
            placed = self.router.place([e.snapshot() for e in healthy], req, t)
            inst = next(e for e in healthy if e.name == placed.instance)
            own = placed.own_seconds
        inst.pending_work.append(own)
        inst.engine.submit(req, on_progress, future=future, speed_ratio=ratio, own_seconds=own)
        self.where[req.id] = inst.name
        self.wake(inst, t)
        return inst.name

    def requeue(self, handoffs: Sequence[Handoff], reason: str, t: float, exclude: frozenset[str] = frozenset(),
                prefer: str | None = None) -> None:
        for h in handoffs:
            if h.request.finished:
                continue
            self._place(h.request, h.future, h.speed_ratio, t, exclude, prefer, h.on_progress)
        if handoffs:
            self.migrations[reason] = self.migrations.get(reason, 0) + len(handoffs)

    def migrate(self, request_id: str, target: str, reason: str = "rebalance", timeout: float = 0.0) -> bool:
        """Move a request to `target` at its source's next step boundary (see module doc)."""
        source_name = self.where.get(request_id)
        if not source_name or source_name == target:
            return False
        source = self.engine(source_name)
        self._after(source, source.engine.hand_over([request_id]),
                    lambda handoffs, t: self.requeue(handoffs, reason, t, prefer=target))
        self.wake(source, self.now)
        return True

    def _after(self, inst: SimInstance, fut: Future, then: Callable[[list, float], None]) -> None:
        """Run `then(result, time)` once `inst` applied a mailbox op (at its next iteration), after
        that iteration, with the time the op was applied at."""
        def done(f: Future) -> None:
            t = inst.clock()
            result = f.result() if f.exception() is None else []
            self._actions.append(lambda: then(result, t))
        fut.add_done_callback(done)

    def reconfigure(self, spec: str, reason: str = "manual") -> SwitchReport:
        """Start a switch to layout `spec` (see module doc); returns its report, finished later."""
        infos = instance_infos(spec, self.num_devices)
        if self.switching:
            raise ClusterBusy("a reconfiguration is already in progress")
        current = {e.name: e for e in self.engines}
        keep = tuple(i.name for i in infos if i.name in current and current[i.name].healthy)
        add = [i for i in infos if i.name not in keep]
        remove = [e for e in self.engines if e.name not in keep]
        old = tuple(i.tp_degree for i in self.infos)
        new = tuple(i.tp_degree for i in infos)
        report = SwitchReport(self.layout, layout_text(new), reason, self.now, kept=keep,
                              added=tuple(i.name for i in add), removed=tuple(e.name for e in remove))
        if not add and not remove:
            report.finished = self.now
            return report
        report.switch_s, report.bytes_moved, report.compiled = self.cost.seconds(old, new,
                                                                                 self.builder.compiled_placements())
        self.switching = True
        self.push(self.now + report.switch_s, SWITCH, self._finish_switch, (infos, add, remove, report))
        return report

    def _finish_switch(self, t: float, payload) -> None:
        infos, add, remove, report = payload
        built = {i.name: self.make_instance(i, t) for i in add}
        by_name = {e.name: e for e in self.engines} | built
        self.engines = [by_name[i.name] for i in infos]
        self.infos = list(infos)
        self.layout = report.new
        self.builder.compiled.update(placements([i.tp_degree for i in infos]))
        removed = frozenset(e.name for e in remove)
        for inst in remove:
            self.retiring[inst.name] = inst
            self._after(inst, inst.engine.hand_over(),
                        lambda handoffs, t_done, inst=inst: self._retire(inst, handoffs, t_done, removed, report))
            self.wake(inst, t)
        self.switching = False
        report.finished = t
        self.reconfigurations.append(report)
        ctl = self.autoscaler.controller if self.autoscaler is not None else None
        if ctl is not None:
            ctl.switched(t)

    def _retire(self, inst: SimInstance, handoffs: list[Handoff], t: float, removed: frozenset[str],
                report: SwitchReport) -> None:
        report.requests_moved += len(handoffs)
        self.requeue(handoffs, "reconfigure", t, exclude=removed)
        inst.engine.stop(timeout=0)
        self.retiring.pop(inst.name, None)
