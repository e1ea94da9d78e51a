"""Builds a real serving Cluster: model loaded into a mesh layout, one JaxRunner + Engine per instance.

This is executor-side code (it touches JAX); the policy modules it wires together stay pure.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dilaserve_jax.decoding.compiled import CompiledSteps
from dilaserve_jax.decoding.state import init_state, state_shardings
from dilaserve_jax.kernels import describe_attention
from dilaserve_jax.mesh import Layout, kv_cache_sharding, load_into_layout
from dilaserve_jax.models.hf import abstract_params
from dilaserve_jax.serving import limits as defaults
from dilaserve_jax.serving.cluster import Cluster, IncompatibleWeights, InstanceInfo, NewWeights, WeightsError
from dilaserve_jax.serving.engine import Engine
from dilaserve_jax.serving.latency import LatencyModel, Profile
from dilaserve_jax.serving.limits import Limits
from dilaserve_jax.serving.runner import JaxRunner
from dilaserve_jax.serving.scheduler import POLICIES, Scheduler, SchedulerConfig
from dilaserve_jax.serving.threshold import ThresholdConfig, eval_rows_beside, prior_from_eval_json

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServeConfig:
    model: str = "tiny"
    mesh: str = "2x4"
    policy: str = "dilaserve"
    slots: int = defaults.DEFAULT_SLOTS  # per instance
    length_buckets: tuple[int, ...] = ()  # default: half and all of min(max_len, DEFAULT_MAX_CANVAS)
    block_buckets: tuple[int, ...] = (32,)  # smaller client blocks run padded in the 32 bucket
    cache_mode: str = "dual"
    attention: str = "auto"
    param_dtype: str | None = None
    max_queue: int = defaults.DEFAULT_MAX_QUEUE
    default_slo_ms: float = defaults.DEFAULT_SLO_MS
    default_max_new_tokens: int = defaults.DEFAULT_MAX_NEW_TOKENS
    default_block_length: int = defaults.DEFAULT_BLOCK_LENGTH
    tau_min: float = defaults.DEFAULT_TAU_MIN
    tau_max: float = defaults.DEFAULT_TAU_MAX
    step_timeout_s: float | None = defaults.DEFAULT_STEP_TIMEOUT_S  # watchdog; None disables
    profile: str | None = None  # latency profile JSON; default: measured on the instances at start-up
    prior: str | None = None  # eval --json rows for the τ -> tokens/step prior; default: eval*.json beside the weights
    allow_unused_devices: bool = False

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots}")
        if self.max_queue < 0 or self.default_slo_ms <= 0:
            raise ValueError("max_queue must be >= 0 and the default SLO positive")
        if self.default_block_length > max(self.block_buckets):
            raise ValueError(f"default block length {self.default_block_length} exceeds the largest block "
                             f"bucket {max(self.block_buckets)}")
        if self.profile is not None and not Path(self.profile).is_file():
            raise ValueError(f"latency profile {self.profile} does not exist")
        if self.default_max_new_tokens < 1:
            raise ValueError(f"default max new tokens must be >= 1, got {self.default_max_new_tokens}")
        if not 0 < self.tau_min <= self.tau_max <= 1:
            raise ValueError(f"need 0 < tau_min <= tau_max <= 1, got {self.tau_min}, {self.tau_max}")
        if self.step_timeout_s is not None and self.step_timeout_s <= 0:
            raise ValueError(f"step timeout must be positive, got {self.step_timeout_s}")


@dataclass
class ServingModel:
    """What the cluster serves: one params tree per local instance, swapped on reload."""

    config: object
    graphdef: object
    tokenizer: object
    source: str
    per_instance: list = field(default_factory=list)


DEFAULT_MAX_CANVAS = 4096  # default largest length bucket: Dream's config allows 32k-131k positions,
#   whose K/V slots would not fit; pass length_buckets to go longer


def _length_buckets(cfg: ServeConfig, max_len: int) -> tuple[int, ...]:
    top = min(max_len, DEFAULT_MAX_CANVAS)
    buckets = cfg.length_buckets or (top // 2, top)
    if max(buckets) > max_len:
        raise ValueError(f"length bucket {max(buckets)} exceeds the model's max_len {max_len}")
    return tuple(sorted(set(buckets)))


def _state_sharding(instance, model_cfg, with_cache: bool):
    template = init_state(model_cfg, 1, 1, with_cache=with_cache)
    return state_shardings(template, kv_cache_sharding(instance, model_cfg), NamedSharding(instance.mesh, P()))


def load_serving_model(cfg: ServeConfig, layout: Layout, source: str | None = None, step: int | None = None):
    loaded, per_instance = load_into_layout(source or cfg.model, layout, param_dtype=cfg.param_dtype, step=step)
    model_cfg = loaded.config.replace(attention=cfg.attention)
    graphdef, _ = abstract_params(model_cfg)  # the graph carries the attention choice
    return ServingModel(model_cfg, graphdef, loaded.tokenizer, loaded.source, per_instance)


def build_cluster(cfg: ServeConfig, say: Callable[[str], None] = print) -> Cluster:
    """Load, lay out and compile; returns a Cluster whose warm_up() measures the latency profile."""
    layout = Layout.build(cfg.mesh, allow_unused=cfg.allow_unused_devices)
    say(f"layout {layout} on {jax.device_count()} {jax.devices()[0].platform} device(s)")
    t0 = time.perf_counter()
    model = load_serving_model(cfg, layout)
    layout.spec.check_model(model.config)
    say(f"model {model.source} ({model.config.num_params / 1e6:.2f} M parameters) loaded in "
        f"{time.perf_counter() - t0:.1f} s; attention: {describe_attention(model.config.attention)}")
    lengths = _length_buckets(cfg, model.config.max_len)
    compiled = CompiledSteps(model.config, model.graphdef)
    runners, infos = [], []
    for inst, params in zip(layout.instances, model.per_instance):
        if params is None:  # another process's instance
            continue
        runner = JaxRunner(model.config, model.graphdef, params, num_slots=cfg.slots, length_buckets=lengths,
                           block_buckets=cfg.block_buckets, cache_mode=cfg.cache_mode, tp_degree=inst.tp,
                           state_sharding=_state_sharding(inst, model.config, cfg.cache_mode != "none"),
                           compiled=compiled, warm_up=False, progress=False)
        runners.append(runner)
        infos.append(InstanceInfo(f"instance-{inst.index}", inst.tp, inst.device_ids))

    given = LatencyModel.from_profile(Profile.load(cfg.profile)) if cfg.profile else None
    placeholder = given or _provisional_latency()
    threshold = _threshold_config(cfg, model.source, say)
    engines = []
    for runner, info in zip(runners, infos):
        sched = Scheduler(SchedulerConfig(num_slots=cfg.slots, policy=cfg.policy, tp=info.tp_degree,
                                          max_queue=cfg.max_queue, threshold=threshold), placeholder)
        engines.append(Engine(runner, sched, name=info.name))

    def warm_up(cluster: Cluster) -> None:
        """On each engine's own thread (it owns the runner), one instance after the other."""
        for engine, info in zip(engines, infos):
            t = time.perf_counter()
            engine.call(lambda r=engine.runner, n=info.name: r.warm_up(progress=True, label=n)).result()
            say(f"{info.name} (TP {info.tp_degree}, devices {list(info.device_ids)}): compiled and warmed "
                f"{len(engine.runner.decoder.config.step_shapes())} step shapes in {time.perf_counter() - t:.1f} s")
        missing = {i.tp_degree for i in infos} - set(given.tp_degrees if given else ())
        if missing:
            _measure_latency(engines, infos, cfg, lengths, say, missing, given)

    tok = model.tokenizer
    limits = Limits(max_len=max(lengths), vocab_size=model.config.vocab_size,
                    reserved_ids=frozenset({model.config.mask_id, model.config.pad_id}),
                    default_max_new_tokens=cfg.default_max_new_tokens,
                    default_block_length=cfg.default_block_length, default_slo_ms=cfg.default_slo_ms,
                    default_tau_min=cfg.tau_min, default_tau_max=cfg.tau_max, max_block_length=max(cfg.block_buckets))

    def load(source: str, step: int | None) -> NewWeights:
        """Runs on the caller's thread: new arrays only; the engines swap them in on their own."""
        try:
            new = load_serving_model(cfg, layout, source, step)
        except Exception as err:  # noqa: BLE001 - any unreadable input is the caller's to fix
            raise WeightsError(f"cannot load weights from {source!r}: {type(err).__name__}: {err}") from err
        if jax.tree.structure(new.per_instance[0]) != jax.tree.structure(model.per_instance[0]) \
                or new.config.replace(name=model.config.name) != model.config:
            raise IncompatibleWeights(f"{source!r} holds a different architecture from the served model "
                                      f"({_describe(new.config)} vs {_describe(model.config)})")
        local = [p for p in new.per_instance if p is not None]
        model.per_instance, model.source = new.per_instance, new.source
        return NewWeights(new.source, {info.name: params for info, params in zip(infos, local)})

    return Cluster(engines, infos, layout=str(layout.spec), policy=cfg.policy, model_source=model.source,
                   tokenizer=tok, limits=limits, loader=load, warmup_fn=warm_up, step_timeout_s=cfg.step_timeout_s,
                   family=model.config.family)


def _describe(c) -> str:
    return f"{c.n_layers} layers, d_model {c.d_model}, {c.n_heads}/{c.n_kv_heads} heads, vocab {c.vocab_size}"


def _threshold_config(cfg: ServeConfig, source: str, say) -> ThresholdConfig:
    """The τ -> tokens/step prior measured by the eval command, when there is one; else the default."""
    path = cfg.prior or eval_rows_beside(source)
    if path is None:
        say("threshold prior: built-in default (no eval rows beside the weights; pass --prior eval.json)")
        return ThresholdConfig()
    prior = prior_from_eval_json(path)
    say(f"threshold prior from {path}: " + ", ".join(f"τ={t:g} {v:.2f} tok/step" for t, v in prior.items()))
    return ThresholdConfig.with_prior(prior)


def _provisional_latency() -> LatencyModel:
    """Used only until the start-up measurement replaces it (no request is scheduled before)."""
    from dilaserve_jax.serving.fake_runner import fake_profile

    return LatencyModel.from_profile(fake_profile())


def _measure_latency(engines, infos, cfg, lengths, say, tps: set[int], given: LatencyModel | None) -> None:
    """Profile one instance of each TP degree the given profile (if any) lacks, on its engine thread,
    and install the fits (also on the engine threads)."""
    from dilaserve_jax.serving.profiling import measure_profile

    t = time.perf_counter()
    by_tp: dict[int, LatencyModel] = {tp: given for tp in {i.tp_degree for i in infos} - tps}
    for engine, info in zip(engines, infos):
        if info.tp_degree in by_tp:
            continue
        runner = engine.runner
        profile = engine.call(lambda r=runner: measure_profile(
            r, batches=r.decoder.config.batch_buckets, lengths=lengths, blocks=cfg.block_buckets, repeats=2,
            progress=False)).result()
        by_tp[info.tp_degree] = LatencyModel.from_profile(profile)
    for engine, info in zip(engines, infos):
        engine.set_latency_model(by_tp[info.tp_degree]).result()
    say(f"measured step-latency profile for TP {sorted(tps)} in {time.perf_counter() - t:.1f} s")
