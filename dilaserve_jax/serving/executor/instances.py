"""Executor side of the instances: weights per instance, runners and engines, warm-up, each TP
degree's latency model (filled by serving/executor/latency_setup.py), temporary instances for
start-up measurements, weight reload and the `InstanceBuilder` a reconfiguration uses
(serving/cluster/builder.py).

Instance names say what they are (`core.layouts.instance_name`): `tp4@0-3` is TP 4 on devices
0-3, `tp1@6` one device. An instance present in two layouts has the same name in both, and a
reconfiguration keeps it.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from typing import Callable, Sequence

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dilaserve_jax.core import layouts
from dilaserve_jax.decoding.compiled import CompiledSteps
from dilaserve_jax.decoding.state import init_state, state_shardings
from dilaserve_jax.mesh import Instance, Layout, kv_cache_sharding, reshard
from dilaserve_jax.models.memory import bytes_per_slot
from dilaserve_jax.serving.cluster.builder import InstanceInfo
from dilaserve_jax.serving.cluster.weights_swap import IncompatibleWeights, NewWeights, WeightsError
from dilaserve_jax.serving.cluster.engine import Engine
from dilaserve_jax.serving.policy.latency import LatencyModel
from dilaserve_jax.serving.executor.runner import JaxRunner
from dilaserve_jax.serving.policy.scheduler import OVERLOAD_RULES_OFF, Scheduler, SchedulerConfig

log = logging.getLogger(__name__)


def executables_shared_by_degree() -> bool:
    """A GPU with the persistent compile cache on: an executable compiled for some devices loads
    for any others of the same count."""
    return jax.default_backend() == "gpu" and bool(jax.config.jax_compilation_cache_dir)


def instance_name(inst: Instance) -> str:
    return layouts.instance_name(inst.device_ids)


def instance_info(inst: Instance) -> InstanceInfo:
    return InstanceInfo(instance_name(inst), inst.tp, inst.device_ids)


class JaxInstanceBuilder:
    """Owns the per-instance weights of the current layout and builds engines for new instances."""

    @property
    def rebuilds_in_place(self) -> bool:
        """A failed instance can be rebuilt from the weights left on its devices (serving/cluster/
        recovery.py): within one process, where this builder reshapes (`plan`)."""
        return jax.process_count() == 1

    def __init__(self, cfg, model, layout: Layout, lengths: tuple[int, ...], threshold, *,
                 latency: dict[int, LatencyModel], placeholder: LatencyModel, say: Callable[[str], None] = print,
                 load_fn: Callable | None = None) -> None:
        self.cfg, self.model, self.layout, self.lengths, self.threshold = cfg, model, layout, lengths, threshold
        self.latency, self.placeholder, self.say, self._load_fn = latency, placeholder, say, load_fn
        self.compiled = CompiledSteps(model.config, model.graphdef)
        self.params = {instance_name(i): p for i, p in zip(layout.instances, model.per_instance) if p is not None}
        self._warmed: set[tuple[int, int]] = set()
        self._lock = threading.Lock()  # params / layout: reload (a gRPC worker) vs reconfiguration

    # --- engines ---
    def local_instances(self, layout: Layout | None = None) -> list[Instance]:
        return [i for i in (layout or self.layout).instances if i.is_local]

    def make_engine(self, inst: Instance, params) -> Engine:
        cfg, mc = self.cfg, self.model.config
        runner = JaxRunner(mc, self.model.graphdef, params, num_slots=cfg.slots, length_buckets=self.lengths,
                           block_buckets=cfg.block_buckets, cache_mode=cfg.cache_mode, tp_degree=inst.tp,
                           state_sharding=state_sharding(inst, mc, cfg.cache_mode != "none"),
                           compiled=self.compiled, warm_up=False, progress=False)
        sched = Scheduler(SchedulerConfig(num_slots=cfg.slots, policy=cfg.policy, tp=inst.tp,
                                          max_queue=cfg.max_queue, admission=cfg.admission, threshold=self.threshold,
                                          **({} if cfg.overload_rules else OVERLOAD_RULES_OFF)),
                          self.latency.get(inst.tp, self.placeholder))
        return Engine(runner, sched, name=instance_name(inst))

    def warm(self, engine: Engine) -> None:
        """Compile and warm its step shapes on the engine's own thread."""
        t = time.perf_counter()
        engine.call(lambda r=engine.runner, name=engine.name: r.warm_up(progress=True, label=name)).result()
        first = min(engine.runner.decoder.devices, key=lambda d: d.id).id
        self._warmed.add((engine.runner.tp_degree, first))
        self.say(f"{engine.name}: compiled and warmed {len(engine.runner.decoder.config.step_shapes())} step shapes "
                 f"in {time.perf_counter() - t:.1f} s")

    def prepare(self, engine: Engine) -> None:
        """Warm it, then install its TP degree's latency model. Nothing is measured here: a
        reconfiguration prepares instances beside serving ones (serving/executor/latency_setup.py
        has every degree's model in hand before the cluster serves)."""
        self.warm(engine)
        engine.set_latency_model(self.latency_for(engine.runner.tp_degree)).result()

    def latency_for(self, tp: int) -> LatencyModel:
        """TP `tp`'s latency model; a degree with none (a manual Reconfigure beyond the degrees
        covered at start-up) takes the nearest covered degree's."""
        if tp in self.latency:
            return self.latency[tp]
        if not self.latency:
            return self.placeholder
        near = min(self.latency, key=lambda t: (abs(math.log2(t / tp)), t))
        log.warning("TP %d has no latency model (it was not covered at start-up); using TP %d's", tp, near)
        self.latency[tp] = _retarget(self.latency[near], near, tp)
        return self.latency[tp]

    def temporary_engine(self, tp: int) -> Engine:
        """A started, warmed engine of TP `tp` over the layout's first `tp` local devices, for a
        start-up measurement (its executables stay cached for that placement, which the widest
        instance of a layout uses); the caller stops it."""
        from dilaserve_jax.mesh import place_params

        devices = [d for d in self.layout.devices if d.process_index == jax.process_index()][:tp]
        if len(devices) < tp:
            raise ValueError(f"TP {tp} needs {tp} devices of this process; it has {len(devices)}")
        inst = Instance.over(0, devices)
        with self._lock:
            source = self._source_for(inst)
        engine = self.make_engine(inst, place_params(source, inst, self.model.config)).start()
        try:
            engine.call(lambda: engine.runner.warm_up(progress=False)).result()
        except BaseException:
            engine.stop()
            raise
        self._warmed.add((tp, inst.device_ids[0]))
        return engine

    # --- InstanceBuilder (serving/cluster/builder.py) ---
    def plan(self, spec: str) -> list[InstanceInfo]:
        if jax.process_count() > 1:
            raise ValueError("run-time reconfiguration works within one process only")
        layout = Layout.build(spec, self.layout.devices, config=self.model.config,
                              allow_unused=self.cfg.allow_unused_devices)
        return [instance_info(i) for i in layout.instances]

    def overlap_fits(self, add: Sequence[InstanceInfo]) -> bool:
        """New weights and KV slots beside the old: checked against each device's free memory when
        the backend reports it (accelerators); a CPU host reports none and is assumed to fit."""
        per_device = _model_bytes(self.model.config) + self.cfg.slots * bytes_per_slot(
            self.model.config, max(self.lengths), self.cfg.cache_mode != "none")
        by_id = {d.id: d for d in self.layout.devices}
        for info in add:
            need = per_device / info.tp_degree
            for i in info.device_ids:
                stats = by_id[i].memory_stats() if hasattr(by_id[i], "memory_stats") else None
                if stats and "bytes_limit" in stats and stats["bytes_limit"] - stats.get("bytes_in_use", 0) < 1.1 * need:
                    return False
        return True

    def build(self, add: Sequence[InstanceInfo], spec: str) -> tuple[list[Engine], int, float]:
        new_layout = Layout.build(spec, self.layout.devices, config=self.model.config,
                                  allow_unused=self.cfg.allow_unused_devices)
        with self._lock:
            old_list = [self.params.get(instance_name(i)) for i in self.layout.instances]
            new_params, report = reshard(old_list, self.layout, new_layout, self.model.config)
            wanted = {a.name for a in add}
            engines = []
            for inst, params in zip(new_layout.instances, new_params):
                name = instance_name(inst)
                if name in wanted:
                    self.params[name] = params
                    engines.append(self.make_engine(inst, params))
            self.layout = new_layout
        return engines, report.bytes_moved, report.seconds

    def release(self, names: Sequence[str]) -> None:
        with self._lock:
            current = {instance_name(i) for i in self.layout.instances}
            for n in names:
                if n not in current:
                    self.params.pop(n, None)

    def compiled_placements(self) -> frozenset[tuple[int, int]]:
        """Placements whose executables are in hand. On a GPU with the persistent compile cache,
        a degree compiled once is in hand for every placement: JAX keys GPU executables without
        their device assignment (jax/_src/cache_key.py), so another placement loads from disk."""
        if executables_shared_by_degree():
            return layouts.every_placement({tp for tp, _ in self._warmed}, len(self.layout.devices))
        return frozenset(self._warmed)

    def compile_count(self) -> int:
        return self.compiled.compile_count

    # --- reload ---
    def load(self, source: str, step: int | None) -> NewWeights:
        """New weights for every current instance (caller's thread: new arrays only)."""
        with self._lock:
            layout = self.layout
        try:
            new = self._load_fn(self.cfg, layout, source, step)
        except Exception as err:  # noqa: BLE001 - any unreadable input is the caller's to fix
            raise WeightsError(f"cannot load weights from {source!r}: {type(err).__name__}: {err}") from err
        old_cfg = self.model.config
        if new.config.replace(name=old_cfg.name) != old_cfg or \
                jax.tree.structure(new.per_instance[0]) != jax.tree.structure(next(iter(self.params.values()))):
            raise IncompatibleWeights(f"{source!r} holds a different architecture from the served model "
                                      f"({_describe(new.config)} vs {_describe(old_cfg)})")
        by_name = {instance_name(i): p for i, p in zip(layout.instances, new.per_instance) if p is not None}
        with self._lock:
            if self.layout is not layout:
                raise WeightsError("the layout changed while the weights loaded; reload again")
            self.params.update(by_name)
            self.model.source = new.source
        return NewWeights(new.source, by_name)

    def adopt(self, params: dict, source: str, layout: Layout) -> NewWeights:
        """Weights already placed on `layout`'s instances (pushed in memory) become the current ones;
        WeightsError if the layout has changed since (place them again)."""
        with self._lock:
            if self.layout is not layout:
                raise WeightsError("the layout changed while the weights were placed")
            self.params.update(params)
            self.model.source = source
        return NewWeights(source, dict(params))

    def _source_for(self, inst: Instance):
        ids = set(inst.device_ids)
        best = max(self.layout.instances, key=lambda i: (len(ids & set(i.device_ids)), -i.index))
        return self.params[instance_name(best)]


def state_sharding(instance: Instance, model_cfg, with_cache: bool):
    template = init_state(model_cfg, 1, 1, with_cache=with_cache)
    return state_shardings(template, kv_cache_sharding(instance, model_cfg), NamedSharding(instance.mesh, P()))


def _retarget(model: LatencyModel, tp: int, new_tp: int) -> LatencyModel:
    """TP `tp`'s fit of `model` as TP `new_tp`'s (the scheduler asks a model for its own degree)."""
    coefs = {(kind, new_tp): c for (kind, t), c in model.coefs.items() if t == tp}
    measured = {(kind, new_tp): g for (kind, t), g in model.measured.items() if t == tp}
    return dataclasses.replace(model, coefs=coefs, measured=measured, label=f"{model.label} (TP {tp}'s, standing in for TP {new_tp})")


def _model_bytes(c) -> int:
    itemsize = 2 if str(getattr(c, "param_dtype", "")) == "bfloat16" else 4
    return c.num_params * itemsize


def _describe(c) -> str:
    return f"{c.n_layers} layers, d_model {c.d_model}, {c.n_heads}/{c.n_kv_heads} heads, vocab {c.vocab_size}"
