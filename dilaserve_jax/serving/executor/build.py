"""Builds a real serving Cluster: model loaded into a mesh layout, one JaxRunner + Engine per instance.

This is executor-side code (it touches JAX); the policy modules it wires together stay pure.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import jax

from dilaserve_jax.core.cli import opt, or_none, words
from dilaserve_jax.core.kinds import CACHE_MODES
from dilaserve_jax.core.layouts import parse_layout
from dilaserve_jax.kernels import IMPLEMENTATIONS, describe_attention
from dilaserve_jax.mesh import Layout, check_model, load_into_layout
from dilaserve_jax.mesh.share import bytes_per_device, parse_device_ids, share_layout
from dilaserve_jax.models.memory import GIB, device_bytes_per_slot, slots_within
from dilaserve_jax.models.hf import abstract_params
from dilaserve_jax.serving.policy import limits as defaults
from dilaserve_jax.serving.cluster.autoscale import MODES, Autoscaler
from dilaserve_jax.serving.cluster.cluster import Cluster
from dilaserve_jax.decoding.decoder import DecoderConfig
from dilaserve_jax.serving.policy.capacity import StepShapes
from dilaserve_jax.serving.policy.controller import ClusterController, ControllerConfig
from dilaserve_jax.serving.policy.hosts_controller import ControlInputs
from dilaserve_jax.serving.executor.instances import JaxInstanceBuilder, instance_info, instance_name
from dilaserve_jax.serving.executor.latency_setup import (LatencySetup, Profiler, candidate_tp_degrees,
                                                          tp_degrees_to_cover)
from dilaserve_jax.serving.executor.profile_cache import ProfileCache
from dilaserve_jax.serving.policy.latency import LatencyModel, Profile
from dilaserve_jax.serving.policy.limits import Limits
from dilaserve_jax.serving.policy.accuracy import AccuracyModel
from dilaserve_jax.serving.policy.quality import BUDGET_MODES
from dilaserve_jax.serving.policy.scheduler import ADMISSION_MODES, POLICIES
from dilaserve_jax.serving.policy.eval_rows import describe_priors, eval_rows_beside, read_eval_rows
from dilaserve_jax.serving.policy.threshold import ThresholdConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServeConfig:
    model: str = opt("tiny", "preset (tiny, test, test_dream), HF directory (LLaDA or Dream), or orbax training directory")
    mesh: str = opt("2x4", 'instances x TP degree, e.g. "2x4", "8", "8x1", "4+2+1+1"')
    policy: str = opt("dilaserve", "scheduling policy", choices=POLICIES)
    slots: int = opt(defaults.DEFAULT_SLOTS, "concurrent requests (decode slots) per instance")
    length_buckets: tuple[int, ...] = ()  # default: half and all of min(max_len, DEFAULT_MAX_CANVAS)
    block_buckets: tuple[int, ...] = (32,)  # smaller client blocks run padded in the 32 bucket
    cache_mode: str = opt("dual", "KV cache mode", name="--cache", aliases=("--cache-mode",), choices=CACHE_MODES)
    attention: str = opt("auto", "attention implementation; auto = Pallas on GPU/TPU, XLA on CPU",
                         choices=IMPLEMENTATIONS)
    param_dtype: str | None = None
    max_queue: int = opt(defaults.DEFAULT_MAX_QUEUE, "waiting requests per instance before RESOURCE_EXHAUSTED")
    default_slo_ms: float = opt(defaults.DEFAULT_SLO_MS, "deadline for calls with neither a gRPC deadline nor slo_ms")
    default_max_new_tokens: int = opt(defaults.DEFAULT_MAX_NEW_TOKENS,
                                      "answer length for calls that do not set max_new_tokens (the default is the tiny "
                                      "model's answer area for its short tasks; raise it for real checkpoints)")
    default_block_length: int = defaults.DEFAULT_BLOCK_LENGTH
    tau_min: float = opt(defaults.DEFAULT_TAU_MIN, "default quality floor")
    tau_max: float | None = opt(None, "the threshold ceiling: requests that set no tau_max run at most at this τ, and "
                                      "the accuracy budget is measured from it (a request may ask for more)",
                                default_text="the accuracy plateau of the eval rows: the lowest τ whose accuracy is "
                                             "within the 95% interval of the best τ's (1.0 without eval rows)")
    admission: str = opt("best-effort", "best-effort: a request predicted to miss its deadline even at tau_min is "
                                        "served late, after every request that can still meet its own; strict: it is "
                                        "refused (a request may ask for either)", choices=ADMISSION_MODES)
    overload_rules: bool = opt(True, "dilaserve: what late requests may take from those still in time - one slot "
                                     "by starvation, a place in a step only if it costs at most 10 percent more, "
                                     "the shortest first (docs/scheduling.md); --no-overload-rules turns them off")
    step_timeout_s: float | None = opt(defaults.DEFAULT_STEP_TIMEOUT_S,  # None disables
                                       "watchdog: an instance whose step runs longer than this is failed and its "
                                       "requests move to the others (0 disables)", parse=or_none(float, "0"))
    rebuild_failed: bool = opt(True, "rebuild a failed instance on its own devices from the weights left there "
                                     "(at most 3 times per instance in 10 minutes); with no instance left, requests "
                                     "wait for it instead of failing")
    controller: str = opt("auto", "cluster controller: auto reshapes the layout and migrates requests as load "
                                  "changes; paused starts it paused (Reconfigure allowed); manual runs none",
                          choices=MODES)  # see serving/cluster/autoscale.py
    layouts: tuple[str, ...] = opt((), "layouts the controller may choose, e.g. '1x8,2x4,4x2,8x1'", parse=words,
                                   metavar="SPEC[,SPEC...]", default_text="every partition of the devices into "
                                   "power-of-two TP groups the model allows")
    controller_config: ControllerConfig = field(default_factory=ControllerConfig)
    profile: str | None = opt(None, "step-latency profile JSON (from `python -m dilaserve_jax.bench.profile`)",
                              default_text="measured at start-up")
    profile_cache: str | None = opt(  # None: no cache (serve resolves the default; see profile_cache.py)
        None, "directory that keeps measured latency profiles between starts, keyed by model, device kind and "
              "shapes ('none': measure at every start)", metavar="DIR",
        default_text="latency-profiles beside --compile-cache; ~/.cache/dilaserve_jax/latency-profiles when that is off")
    prior: str | None = opt(None, "eval rows (`python -m dilaserve_jax.tasks.eval --json`) for the threshold "
                                  "controller's tokens-per-step and accuracy priors",
                            default_text="eval*.json beside the weights")
    max_accuracy_drop: float | None = opt(1.0, "bound on the mean predicted accuracy drop, in points vs the accuracy "
                                               "at the τ ceiling (--tau-max), over the requests each instance serves ('inf' = "
                                               "unbounded); a request may set its own", metavar="PTS",
                                          parse=or_none(float, "inf", "none", "unbounded"))
    budget_mode: str = opt("adaptive", "adaptive: spend the budget per request on first-step evidence, where it buys "
                                       "deadlines; floor: the lowest τ within budget for everyone", choices=BUDGET_MODES)
    allow_unused_devices: bool = False
    devices: tuple[int, ...] | None = opt(None, 'serve on these visible devices only: "4-7", "4,5,6,7" or "0-1,6-7"; '
                                                "the mesh must use exactly that many", aliases=("--device-ids",),
                                          parse=parse_device_ids, metavar="IDS", default_text="all")
    kv_memory_gb: float | None = opt(None, "per-device memory (GiB) for the decode slots' K/V cache and canvases: "
                                           "each instance gets as many slots as fit, at most --slots", metavar="GIB",
                                     default_text="--slots, whatever they take")

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
        if not 0 < self.tau_min <= (1 if self.tau_max is None else self.tau_max) <= 1:
            raise ValueError(f"need 0 < tau_min <= tau_max <= 1, got {self.tau_min}, {self.tau_max}")
        if self.admission not in ADMISSION_MODES:
            raise ValueError(f"admission must be one of {ADMISSION_MODES}, got {self.admission!r}")
        if self.step_timeout_s is not None and self.step_timeout_s <= 0:
            raise ValueError(f"step timeout must be positive, got {self.step_timeout_s}")
        if self.controller not in MODES:
            raise ValueError(f"controller must be one of {MODES}, got {self.controller!r}")
        for spec in self.layouts:
            parse_layout(spec)
        if self.devices is not None:
            object.__setattr__(self, "devices", tuple(int(d) for d in self.devices))
            if not self.devices or len(set(self.devices)) != len(self.devices):
                raise ValueError(f"devices must be distinct ids, got {self.devices}")
        if self.kv_memory_gb is not None and not self.kv_memory_gb > 0:
            raise ValueError(f"the KV memory budget must be positive, got {self.kv_memory_gb}")
        if self.max_accuracy_drop is not None and not 0 <= self.max_accuracy_drop < float("inf"):
            raise ValueError(f"max accuracy drop must be a finite number of points >= 0, got {self.max_accuracy_drop}")
        if self.budget_mode not in BUDGET_MODES:
            raise ValueError(f"budget mode must be one of {BUDGET_MODES}, got {self.budget_mode!r}")


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


def load_serving_model(cfg: ServeConfig, layout: Layout, source: str | None = None, step: int | None = None):
    loaded, per_instance = load_into_layout(source or cfg.model, layout, param_dtype=cfg.param_dtype, step=step)
    model_cfg = loaded.config.replace(attention=cfg.attention)
    graphdef, _ = abstract_params(model_cfg)  # the graph carries the attention choice
    return ServingModel(model_cfg, graphdef, loaded.tokenizer, loaded.source, per_instance)


def build_cluster(cfg: ServeConfig, say: Callable[[str], None] = print, *, layout: Layout | None = None,
                  model: ServingModel | None = None, profiler: Profiler | None = None,
                  run_controller: bool = True) -> Cluster:
    """Load, lay out and compile; returns a Cluster whose warm_up() compiles every instance, gives
    every TP degree it may run a latency model (serving/executor/latency_setup.py) and (unless
    --controller manual) starts the cluster controller, all before it serves. `layout` and `model`
    (already placed in it, e.g. from memory) replace building and loading them; `profiler` replaces
    `profiling.measure_profile`; `run_controller=False` covers the degrees but starts no controller
    (a host of a multi-host server, whose leader's controller decides)."""
    layout = layout or share_layout(cfg.mesh, cfg.devices, allow_unused=cfg.allow_unused_devices)
    share = f"devices {list(cfg.devices)} of " if cfg.devices is not None else ""
    say(f"layout {layout} on {share}{jax.device_count()} {jax.devices()[0].platform} device(s)")
    t0 = time.perf_counter()
    model = model or load_serving_model(cfg, layout)
    check_model(layout.spec, model.config)
    say(f"model {model.source} ({model.config.num_params / 1e6:.2f} M parameters) loaded in "
        f"{time.perf_counter() - t0:.1f} s; attention: {describe_attention(model.config.attention)}")
    lengths = _length_buckets(cfg, model.config.max_len)
    cfg = _fit_kv_budget(cfg, model.config, layout, max(lengths))
    given = LatencyModel.from_profile(Profile.load(cfg.profile)) if cfg.profile else None
    latency = {tp: given for tp in (given.tp_degrees if given else ())}
    threshold, cfg = resolve_threshold(cfg, model.source, say)
    builder = JaxInstanceBuilder(cfg, model, layout, lengths, threshold,
                                 latency=latency, placeholder=given or _provisional_latency(), say=say,
                                 load_fn=load_serving_model)
    instances = builder.local_instances()
    engines = [builder.make_engine(inst, builder.params[instance_name(inst)]) for inst in instances]
    infos = [instance_info(inst) for inst in instances]
    _say_memory(cfg, model.config, builder, instances, max(lengths), say)
    limits = Limits(max_len=max(lengths), vocab_size=model.config.vocab_size,
                    reserved_ids=frozenset({model.config.mask_id, model.config.pad_id}),
                    default_max_new_tokens=cfg.default_max_new_tokens,
                    default_block_length=cfg.default_block_length, default_slo_ms=cfg.default_slo_ms,
                    default_tau_min=cfg.tau_min, default_tau_max=cfg.tau_max, max_block_length=max(cfg.block_buckets))

    cache = ProfileCache(cfg.profile_cache) if cfg.profile_cache not in (None, "none") else None
    setup = LatencySetup(builder, cache, profiler)

    def warm_up(cluster: Cluster) -> None:
        """On each engine's own thread (it owns the runner), one instance after the other; then every
        TP degree's latency model, while no instance serves."""
        for engine in cluster.engines:
            builder.warm(engine)
        setup.cover(cluster, tp_degrees_to_cover(cfg, model.config, layout))
        for engine in cluster.engines:
            engine.set_latency_model(builder.latency_for(engine.runner.tp_degree)).result()
        if run_controller and cfg.controller != "manual" and not cluster.stopping:
            start_controller(cluster, builder, cfg, say)

    cluster = Cluster(engines, infos, layout=str(layout.spec), policy=cfg.policy, model_source=model.source,
                      tokenizer=model.tokenizer, limits=limits, loader=builder.load, warmup_fn=warm_up,
                      step_timeout_s=cfg.step_timeout_s, family=model.config.family, builder=builder)
    cluster.recovery.enabled = cfg.rebuild_failed
    cluster.autoscaler = Autoscaler(cluster, None, mode=cfg.controller)  # its controller comes after warm-up
    return cluster


def _fit_kv_budget(cfg: ServeConfig, model_cfg, layout: Layout, length: int) -> ServeConfig:
    """With a per-device KV budget: as many slots as it holds (at most `slots`) on an instance of the
    narrowest TP degree any layout of these devices may use, so the budget holds after reshaping."""
    if cfg.kv_memory_gb is None:
        return cfg
    tp = min(candidate_tp_degrees(cfg, model_cfg, len(layout.devices)) + [i.tp for i in layout.instances])
    slots = slots_within(model_cfg, tp, length, int(cfg.kv_memory_gb * GIB), cfg.slots, cfg.cache_mode != "none")
    return dataclasses.replace(cfg, slots=slots)


def _say_memory(cfg: ServeConfig, model_cfg, builder, instances, length: int, say) -> None:
    """Per instance: its slots and what its weights and decode state take on each of its devices."""
    budget = f" (KV budget {cfg.kv_memory_gb:g} GiB per device)" if cfg.kv_memory_gb is not None else ""
    for inst in instances:
        weights = max(bytes_per_device(builder.params[instance_name(inst)]).values())
        state = cfg.slots * device_bytes_per_slot(model_cfg, inst.tp, length, cfg.cache_mode != "none")
        say(f"{instance_name(inst)}: {cfg.slots} slot(s); per device {weights / 2**20:.1f} MiB weights + "
            f"{state / 2**20:.1f} MiB decode state{budget}")


def start_controller(cluster: Cluster, builder: JaxInstanceBuilder, cfg: ServeConfig, say) -> None:
    """Hand the controller to the cluster's autoscaler, over the candidate TP degrees that have a
    latency model (all of them, but those this process's devices cannot hold)."""
    tps, floor = controlled_tp_degrees(builder, cfg), tau_floor(builder, cfg)
    ctl = ClusterController(cfg.controller_config, num_devices=len(builder.layout.devices), tp_degrees=tps,
                            latency=dict(builder.latency), slots=cfg.slots,
                            param_bytes=_param_bytes(builder.model.config), layouts=cfg.layouts or None,
                            tau_floor=floor, prior=dict(builder.threshold.prior), shapes=step_shapes(builder),
                            pressure_share=pressure_share(builder, cfg))
    cluster.autoscaler.set_controller(ctl)
    say(f"controller: {cfg.controller}, {len(ctl.candidates)} candidate layouts over TP {tps}; prices layouts at "
        f"τ down to {floor:g} (the lowest the accuracy budget allows)")


def controlled_tp_degrees(builder: JaxInstanceBuilder, cfg: ServeConfig) -> list[int]:
    """The candidate TP degrees that have a latency model."""
    return [t for t in candidate_tp_degrees(cfg, builder.model.config, len(builder.layout.devices))
            if t in builder.latency]


def tau_floor(builder: JaxInstanceBuilder, cfg: ServeConfig) -> float:
    """The lowest τ the controller prices layouts at: the lowest the accuracy budget allows."""
    quality = builder.threshold.quality
    return cfg.tau_min if quality is None or cfg.tau_max is None else \
        quality.free_floor(cfg.tau_min, cfg.tau_max, builder.threshold.grid)


def pressure_share(builder: JaxInstanceBuilder, cfg: ServeConfig) -> float | None:
    """The instances' arrival-pressure share, for the controller's prediction (None where the rule
    cannot act: another policy, or no accuracy budget)."""
    t = builder.threshold
    return t.pressure_at_risk_share if cfg.policy == "dilaserve" and t.quality is not None else None


def control_inputs(builder: JaxInstanceBuilder) -> ControlInputs:
    """What the controller needs of these devices once warm (a host of a multi-host server sends
    it to its leader), from the builder's settings."""
    cfg = builder.cfg
    tps = controlled_tp_degrees(builder, cfg)
    return ControlInputs(len(builder.layout.devices), tuple(tps), {t: builder.latency[t] for t in tps}, cfg.slots,
                         _param_bytes(builder.model.config), tau_floor(builder, cfg), dict(builder.threshold.prior),
                         step_shapes(builder), pressure_share(builder, cfg))


def step_shapes(builder: JaxInstanceBuilder) -> StepShapes:
    """How this server's decoder runs a step (its length and batch buckets), so the controller
    prices a round as the instances will run it, as the simulator's calibration does."""
    cfg = builder.cfg
    batches = DecoderConfig(cfg.slots, builder.lengths, cfg.block_buckets, cfg.cache_mode).batch_buckets
    return StepShapes(tuple(builder.lengths), tuple(batches))


def _param_bytes(c) -> int:
    return c.num_params * (2 if str(getattr(c, "param_dtype", "")) == "bfloat16" else 4)


def resolve_threshold(cfg: ServeConfig, source: str, say) -> tuple[ThresholdConfig, ServeConfig]:
    """The τ -> tokens/step and τ -> accuracy priors measured by the eval command, with the accuracy-loss
    budget, when there are eval rows; else the built-in speed prior and no budget (it cannot be priced).
    Returns it with `cfg` whose τ ceiling is resolved: --tau-max, else the rows' accuracy plateau."""
    path = cfg.prior or eval_rows_beside(source)
    if path is None:
        ceiling = 1.0 if cfg.tau_max is None else cfg.tau_max
        say(f"τ ceiling {ceiling:g} ({'--tau-max' if cfg.tau_max is not None else 'no eval rows to find the accuracy plateau on'})")
        say("threshold prior: built-in default (no eval rows beside the weights; pass --prior eval.json); "
            "accuracy budget NOT enforced: no accuracy model")
        return ThresholdConfig(), dataclasses.replace(cfg, tau_max=ceiling)
    rows = read_eval_rows(path)  # refuses rows without accuracy
    say(f"threshold priors from {path}: {describe_priors(rows)}")
    if cfg.tau_max is not None:
        ceiling, why = cfg.tau_max, "--tau-max"
    else:
        plateau = AccuracyModel.from_eval(rows).plateau()
        ceiling, why = max(plateau.tau, cfg.tau_min), f"default: {plateau.describe()}; --tau-max overrides"
    say(f"τ ceiling {ceiling:g} ({why})")
    budget = "unbounded" if cfg.max_accuracy_drop is None else f"{cfg.max_accuracy_drop:g} points"
    say(f"accuracy budget: {budget} mean predicted drop vs the accuracy at τ {ceiling:g} ({cfg.budget_mode})")
    threshold = ThresholdConfig.from_eval(rows, max_accuracy_drop=cfg.max_accuracy_drop, budget_mode=cfg.budget_mode,
                                          reference_tau=ceiling)
    return threshold, dataclasses.replace(cfg, tau_max=ceiling)


def _provisional_latency() -> LatencyModel:
    """Used only until the start-up measurement replaces it (no request is scheduled before)."""
    from dilaserve_jax.serving.cluster.fake_runner import fake_profile

    return LatencyModel.from_profile(fake_profile())


