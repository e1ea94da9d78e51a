"""One host's side of a multi-host server: its engines, and the reports it sends the leader.

A `HostWorker` runs inside the host's worker process (a Ray actor, see ray_hosts.py). It builds
and owns the engines of that host's devices and takes operations from the leader in ordered
batches (`apply`): add a request, abort one, hand some over. What happens on the engines comes
back through one ordered report buffer that the leader drains with `poll`:

  ("step", instance, request id, host state, step records, positions, tokens, progress)
  ("done", instance, request id, result)                 a request finished
  ("handed", instance, token, [(request, speed ratio)])  a hand-over the leader asked for
  ("failed", instance, fault, [(request, speed ratio)])  an instance failed; its requests
  ("swapped", instance, token, clock time, fault)        a weight swap the leader asked for
  ("steps", "", StepCounts)                              the host's step metrics since the last poll

Weights reach a host in two phases (the leader's `HostsWeights`): `load_weights` reads and places
them on this host's instances, then one "swap" operation per instance swaps them in between two of
its steps; `undo_weights` puts the previous ones back when another host could not load them.

How often a request's commits are reported: after every step when its caller streams (the
report carries the step's progress for the stream), else at the end of every block (the records
and committed tokens of the block's steps in one report). The leader then holds each request's
canvas as of its last finished block at worst, so when this process dies it re-queues them from
there and repeats at most one block's steps, at a fraction of the reports. The reports are
appended on the engine threads in step order, so a request's steps always reach the leader
before its result or its hand-over.

Pure Python (no Ray, no JAX): the engines come from a `HostFactory`, fake runners in tests and
the JAX executor when serving (serving/executor/hosts.py).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Protocol, Sequence

from dilaserve_jax.serving.cluster.builder import InstanceBuilder, InstanceInfo
from dilaserve_jax.serving.cluster.engine import Engine
from dilaserve_jax.serving.cluster.engine_types import EngineUnavailable, Handoff, StepProgress, describe_error
from dilaserve_jax.serving.cluster.hosts.step_tally import StepTally
from dilaserve_jax.serving.cluster.weights_swap import NewWeights
from dilaserve_jax.serving.policy.hosts_controller import ControlInputs
from dilaserve_jax.serving.policy.request import Request

log = logging.getLogger(__name__)

# the fields of a Request a step changes: copied to the leader's copy after every step
HOST_STATE_FIELDS = ("state", "start_time", "finish_time", "committed", "block_index", "block_committed",
                     "needs_refresh", "at_risk", "steps_skipped", "moves", "evidence", "predicted_loss")


@dataclass(frozen=True, slots=True)
class HostBuild:
    """What a factory builds on one host: engines (not started) and what the leader serves with."""

    engines: Sequence[Engine]
    infos: Sequence[InstanceInfo]
    tokenizer: Any = None
    limits: Any = None
    policy: str = ""
    model_source: str = ""
    family: str = ""
    warm_up: Callable[[], None] | None = None  # after the engines started: compile and warm them
    builder: InstanceBuilder | None = None  # reshapes this host's layout (None: it is fixed)
    control: Callable[[], ControlInputs] | None = None  # after warm-up: what the leader's controller needs
    weights: "HostWeights | None" = None  # reloads (None: this host cannot reload)


class HostWeights(Protocol):
    """A host's weight reloads: `load` reads new weights and places them on every current instance
    (they become the ones new instances are built from); `undo` puts back those from before the
    last `load` (another host could not load them); `settle`: every instance swapped the new ones
    in, the previous ones need not be kept."""

    def load(self, source: str, step: int | None) -> NewWeights:
        ...

    def undo(self) -> None:
        ...

    def settle(self) -> None:
        ...


class HostFactory(Protocol):
    """Builds a host's engines inside its worker process (it must pickle: it travels there)."""

    def build(self, host: str) -> HostBuild:
        ...


@dataclass(frozen=True, slots=True)
class HostInfo:
    """What the leader learns of a worker when it starts."""

    host: str
    pid: int
    infos: tuple[InstanceInfo, ...]  # names local to the host
    tokenizer: Any
    limits: Any
    policy: str
    model_source: str
    family: str
    control: ControlInputs | None = None


@dataclass(slots=True)
class _Unsent:
    """A request's commits since its last step report (engine thread only)."""

    stream: bool  # its caller follows every step
    steps_sent: int  # step records the leader has
    positions: list = field(default_factory=list)
    tokens: list = field(default_factory=list)


def _shifted(offset_s: float) -> float:
    return time.monotonic() + offset_s


def host_state(request: Request) -> tuple:
    return tuple(getattr(request, f) for f in HOST_STATE_FIELDS)


class HostWorker:
    def __init__(self, host: str, factory: HostFactory, watchdog_s: float | None = None) -> None:
        self.host = host
        built = factory.build(host)
        self.engines = {e.name: e for e in built.engines}  # replaced whole on reshaping (the poller reads it)
        self._built = built
        self._offset_s = 0.0
        self._cv = threading.Condition()
        self._reports: list[tuple] = []
        self.steps = StepTally()  # every engine's steps, for the leader's step metrics
        self._loaded: dict[str, Any] = {}  # weights loaded, not yet swapped in, by instance
        for e in built.engines:
            e.on_failure = self._instance_failed
            e.add_step_hook(self.steps)
            e.start()
        if built.warm_up is not None:
            built.warm_up()
        self._stop = threading.Event()
        if watchdog_s is not None:  # a hung runner call fails its instance, as in one process
            threading.Thread(target=self._watch, args=(watchdog_s,), name="host-watchdog", daemon=True).start()

    def info(self) -> HostInfo:
        b = self._built
        return HostInfo(self.host, os.getpid(), tuple(b.infos), b.tokenizer, b.limits, b.policy, b.model_source,
                        b.family, b.control() if b.control is not None else None)

    def pid(self) -> int:
        return os.getpid()

    def monotonic(self) -> float:
        return time.monotonic()

    def set_clock_offset(self, offset_s: float) -> None:
        """Run the engines on the leader's clock (this host's monotonic clock + `offset_s`): request
        arrivals and deadlines come from the leader, and monotonic clocks differ between machines."""
        self._offset_s = offset_s
        for e in self.engines.values():
            e.clock = partial(_shifted, offset_s)

    # --- reshaping this host (the leader's reconfiguration drives it, see hosts_builder.py) ---
    def plan(self, spec: str) -> list[InstanceInfo]:
        return [dataclasses.replace(i, host=self.host) for i in self._builder().plan(spec)]

    def overlap_fits(self, add: Sequence[InstanceInfo]) -> bool:
        return self._builder().overlap_fits(add)

    def build(self, add: Sequence[InstanceInfo], spec: str) -> tuple[dict, int, float]:
        """Build, start and warm the new instances (weights resharded on this host's devices);
        returns their first snapshots by name, the bytes moved and the reshard seconds."""
        builder = self._builder()
        engines, moved, reshard_s = builder.build(add, spec)
        for e in engines:
            e.on_failure = self._instance_failed
            e.clock = partial(_shifted, self._offset_s)
            e.add_step_hook(self.steps)
            e.start()
            builder.prepare(e)
        replaced = [self.engines[e.name] for e in engines if e.name in self.engines]  # failed ones, rebuilt
        self.engines = {**self.engines, **{e.name: e for e in engines}}
        for old in replaced:
            try:
                old.stop(5.0)
            except TimeoutError:  # a hung runner call: its thread is left to finish on its own
                log.warning("replaced engine %s did not stop", old.name)
        return {e.name: e.snapshot() for e in engines}, moved, reshard_s

    def release(self, names: Sequence[str]) -> None:
        """Stop removed instances (emptied by the leader's hand-over) and drop their weights."""
        gone = [self.engines[n] for n in names if n in self.engines]
        self.engines = {n: e for n, e in self.engines.items() if n not in set(names)}
        for e in gone:
            e.stop(5.0)
        self._builder().release(names)

    # --- weights (the leader's reload drives it, see hosts_weights.py) ---
    def load_weights(self, source: str, step: int | None) -> tuple[str, tuple[str, ...]]:
        """Read new weights and place them on this host's instances (not swapped in yet); returns
        their label and the instances they are for. Raises what the loader raises."""
        if self._built.weights is None:
            raise ValueError(f"host {self.host} cannot reload weights")
        new = self._built.weights.load(source, step)
        self._loaded = {n: p for n, p in new.params.items() if n in self.engines and self.engines[n].healthy}
        return new.source, tuple(self._loaded)

    def undo_weights(self) -> None:
        """Drop the weights loaded and put the previous ones back."""
        self._loaded = {}
        if self._built.weights is not None:
            self._built.weights.undo()

    def reload_now(self, source: str, step: int | None, timeout: float = 600.0) -> str:
        """Load and swap in at once, on every instance (a host that joins after a reload, before it
        serves); returns the weights' label."""
        label, names = self.load_weights(source, step)
        swaps = [self.engines[n].swap_weights(self._loaded.pop(n)) for n in names if n in self.engines]
        for fut in swaps:
            fut.result(timeout)
        self._built.weights.settle()
        self._built = dataclasses.replace(self._built, model_source=label)
        return label

    def _swap(self, name: str, token: int) -> None:
        if name not in self._loaded:
            self._report(("swapped", name, token, None, f"no weights were loaded for instance {name}"))
            return
        params = self._loaded.pop(name)
        if not self._loaded:
            self._built.weights.settle()
        self.engines[name].swap_weights(params).add_done_callback(partial(self._swapped, name, token))

    def _swapped(self, name: str, token: int, fut: Future) -> None:
        err = fut.exception()
        if err is None:
            self._report(("swapped", name, token, fut.result(), None))
        else:
            fault = "unavailable" if isinstance(err, EngineUnavailable) else describe_error(err)
            self._report(("swapped", name, token, None, fault))

    def _builder(self) -> InstanceBuilder:
        if self._built.builder is None:
            raise ValueError(f"host {self.host} cannot reshape its layout")
        return self._built.builder

    # --- from the leader ---
    def apply(self, ops: Sequence[tuple]) -> int:
        """Apply a batch of operations in order; returns how many."""
        for op in ops:
            kind, name = op[0], op[1]
            engine = self.engines[name]
            if kind == "add":
                _, _, request, speed_ratio, own_seconds, stream = op
                self._add(engine, request, speed_ratio, own_seconds, stream)
            elif kind == "abort":
                engine.abort(op[2])
            elif kind == "hand_over":
                _, _, ids, token = op
                engine.hand_over(ids).add_done_callback(partial(self._handed, name, token))
            elif kind == "swap":
                self._swap(name, op[2])
            else:
                raise ValueError(f"unknown operation {kind!r}")
        return len(ops)

    def poll(self, wait_s: float) -> tuple[list[tuple], dict]:
        """The reports since the last poll (waiting up to `wait_s` for one), with every engine's
        latest snapshot (taken after the reports, so it never runs behind them)."""
        deadline = time.monotonic() + wait_s
        with self._cv:
            while not self._reports and not self._stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            reports, self._reports = self._reports, []
        counts = self.steps.take()
        if counts is not None:
            reports.append(("steps", "", counts))
        return reports, {name: e.snapshot() for name, e in self.engines.items()}  # (a reshape swaps the dict whole)

    def stop(self) -> None:
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        for e in self.engines.values():
            try:
                e.stop(5.0)
            except TimeoutError:
                log.warning("engine %s did not stop", e.name)

    # --- engine threads ---
    def _add(self, engine: Engine, request: Request, speed_ratio, own_seconds, stream: bool) -> None:
        fut: Future = Future()
        unsent = _Unsent(stream, len(request.steps))
        try:
            engine.submit(request, partial(self._stepped, engine.name, request, unsent), future=fut,
                          speed_ratio=speed_ratio, own_seconds=own_seconds)
        except EngineUnavailable as err:  # failed meanwhile: the leader moves it with the others
            self._report(("failed", engine.name, f"{type(err).__name__}: {err}", [(request, speed_ratio)]))
            return
        fut.add_done_callback(partial(self._finished, engine.name, request.id))

    def _stepped(self, name: str, request: Request, unsent: "_Unsent", progress: StepProgress) -> None:
        # on the engine thread, right after the step was recorded: the request is ours to read
        unsent.positions.extend(progress.positions)
        unsent.tokens.extend(progress.tokens)
        if not unsent.stream and request.block_committed:  # mid-block: the block's end reports it
            return
        records = tuple(request.steps[unsent.steps_sent:])
        unsent.steps_sent = len(request.steps)
        positions, tokens = tuple(unsent.positions), tuple(unsent.tokens)
        unsent.positions.clear()
        unsent.tokens.clear()
        self._report(("step", name, request.id, host_state(request), records, positions, tokens,
                      progress if unsent.stream else None))

    def _finished(self, name: str, request_id: str, fut: Future) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return  # the engine stopped or failed: its failure report carries the request
        self._report(("done", name, request_id, fut.result()))

    def _handed(self, name: str, token: int, fut: Future) -> None:
        handoffs = [] if fut.exception() is not None else fut.result()
        self._report(("handed", name, token, [(h.request, h.speed_ratio) for h in handoffs]))

    def _instance_failed(self, engine: Engine, handoffs: list[Handoff], error: BaseException) -> None:
        self._report(("failed", engine.name, f"{type(error).__name__}: {error}",
                      [(h.request, h.speed_ratio) for h in handoffs]))

    def _report(self, report: tuple) -> None:
        with self._cv:
            self._reports.append(report)
            self._cv.notify_all()

    def _watch(self, limit_s: float) -> None:
        while not self._stop.wait(min(1.0, limit_s / 4)):
            for e in self.engines.values():
                e.check_hung(limit_s)
