"""A latency model for every TP degree the cluster may run, in hand before it serves.

During warm-up, before `ready:` and while every Generate call is still refused, each TP degree of
`tp_degrees_to_cover` gets its model: from `--profile`, else the profile cache
(serving/executor/profile_cache.py), else a measurement (serving/executor/profiling.py) on an
instance of that degree that is compiled but not serving yet, or on a temporary instance over the
layout's first devices, stopped again afterwards. A measured profile goes into the cache, so the
next start with the same model, devices and shapes reads it. Once the cluster serves nothing is
measured again: every device then holds a serving instance.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import jax

from dilaserve_jax.core.kinds import CacheMode
from dilaserve_jax.core.layouts import parse_layout
from dilaserve_jax.decoding.decoder import DecoderConfig
from dilaserve_jax.mesh import Layout, check_model_tp
from dilaserve_jax.serving.cluster.cluster import Cluster
from dilaserve_jax.serving.cluster.engine import Engine
from dilaserve_jax.serving.executor.instances import JaxInstanceBuilder
from dilaserve_jax.serving.executor.profile_cache import PROFILE_FORMAT, ProfileCache, ProfileKey, model_identity
from dilaserve_jax.serving.policy.latency import LatencyModel, Profile

Profiler = Callable[..., Profile]  # profiling.measure_profile's signature
MEASURE_REPEATS = 2


def candidate_tp_degrees(cfg, model_cfg, num_devices: int) -> list[int]:
    """TP degrees the controller may use: powers of two up to the devices that the model allows,
    or those of the --layouts given."""
    if cfg.layouts:
        return sorted({t for spec in cfg.layouts for t in parse_layout(spec)})
    out = []
    tp = 1
    while tp <= num_devices:
        try:
            check_model_tp(model_cfg, tp)
            out.append(tp)
        except ValueError:
            pass
        tp *= 2
    return out


def local_devices(layout: Layout) -> list:
    return [d for d in layout.devices if d.process_index == jax.process_index()]


def tp_degrees_to_cover(cfg, model_cfg, layout: Layout) -> list[int]:
    """The initial layout's own degrees and, with a controller (auto or paused, which also takes
    Reconfigure calls), every degree it may choose that this process's devices can hold."""
    tps = {i.tp for i in layout.local_instances()}
    if cfg.controller != "manual":
        room = len(local_devices(layout))
        tps |= {t for t in candidate_tp_degrees(cfg, model_cfg, len(layout.devices)) if t <= room}
    return sorted(tps)


class LatencySetup:
    """Fills `builder.latency` for the degrees asked, before the cluster serves."""

    def __init__(self, builder: JaxInstanceBuilder, cache: ProfileCache | None = None,
                 profiler: Profiler | None = None) -> None:
        if profiler is None:
            from dilaserve_jax.serving.executor.profiling import measure_profile as profiler
        self.builder, self.cache, self.profiler = builder, cache, profiler
        self.measured: list[int] = []  # degrees measured here (not given, not read from the cache)

    def key(self, tp: int) -> ProfileKey:
        b = self.builder
        cfg, model = b.cfg, b.model
        device = b.layout.devices[0]
        batches = DecoderConfig(cfg.slots, b.lengths, cfg.block_buckets, cfg.cache_mode).batch_buckets
        return ProfileKey(model.config.name, model_identity(model.source, model.config),
                          f"{device.platform}:{device.device_kind}", tp, tuple(b.lengths), tuple(cfg.block_buckets),
                          tuple(batches), CacheMode(cfg.cache_mode).value, f"jax {jax.__version__}, format {PROFILE_FORMAT}")

    def cover(self, cluster: Cluster, tps: Sequence[int]) -> None:
        """A model for each of `tps` (stops early when the cluster stops). Refuses to run once the
        cluster serves: a measurement would then share devices with serving instances."""
        if cluster.ready:
            raise RuntimeError("latency models are set up before the cluster serves, not after")
        say = self.builder.say
        for tp in tps:
            if cluster.stopping:
                return
            if tp in self.builder.latency:
                continue
            key = self.key(tp)
            profile = self.cache.load(key) if self.cache is not None else None
            if profile is not None:
                say(f"latency model of TP {tp}: read from {self.cache.path(key)}")
            else:
                t = time.perf_counter()
                profile = self._measure(tp, cluster.engines)
                self.measured.append(tp)
                kept = self.cache.save(key, profile) if self.cache is not None else None
                say(f"latency model of TP {tp}: measured in {time.perf_counter() - t:.1f} s before serving"
                    + (f", kept in {kept}" if kept else ""))
            self.builder.latency[tp] = LatencyModel.from_profile(profile)

    def _measure(self, tp: int, engines: Sequence[Engine]) -> Profile:
        own = next((e for e in engines if e.runner.tp_degree == tp and e.healthy), None)
        if own is not None:
            return self._profile_on(own)
        engine = self.builder.temporary_engine(tp)
        try:
            return self._profile_on(engine)
        finally:
            engine.stop()

    def _profile_on(self, engine: Engine) -> Profile:
        b = self.builder
        return engine.call(lambda r=engine.runner: self.profiler(
            r, batches=r.decoder.config.batch_buckets, lengths=b.lengths, blocks=b.cfg.block_buckets,
            repeats=MEASURE_REPEATS, progress=False)).result()
