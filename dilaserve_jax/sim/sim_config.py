"""The simulator's configuration: one dataclass, its fields the `sim` command's flags (`core.cli.opt`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from dilaserve_jax.core.cli import opt, or_none, words
from dilaserve_jax.core.layouts import is_schedule, parse_layout, parse_schedule
from dilaserve_jax.serving.policy.controller import ControllerConfig
from dilaserve_jax.serving.policy.limits import DEFAULT_MAX_QUEUE
from dilaserve_jax.serving.policy.quality import BUDGET_MODES
from dilaserve_jax.serving.policy.scheduler import POLICIES
from dilaserve_jax.sim.policies import ABLATIONS


COMPILE_CACHES = ("by-degree", "per-placement")


@dataclass(frozen=True, slots=True)
class SimConfig:
    devices: int = opt(8, "devices in the cluster")
    policy: str = opt("dilaserve", "scheduling policy", choices=POLICIES)
    layout: str = "auto"  # a mesh spec, auto (dilaserve only: the controller chooses) or a schedule
    initial_layout: str | None = opt(None, "auto: starting layout",
                                     default_text="the one predicted best for the first window of arrivals")
    layouts: tuple[str, ...] = opt((), "auto: comma-separated candidate layouts", parse=words,
                                   default_text="all partitions")
    tp_degrees: tuple[int, ...] = opt((1, 2, 4, 8), "TP degrees allowed", name="--tp")
    ablate: frozenset[str] = opt(frozenset(), f"dilaserve without: comma-separated of {', '.join(ABLATIONS)}",
                                 parse=lambda text: frozenset(words(text)))
    slots: int = opt(8, "slots per instance")
    static_tau: float = opt(0.9, "τ of the static policies")
    tau_min: float = opt(0.6, "per-request τ floor")
    tau_max: float = opt(0.9, "per-request τ ceiling")
    max_queue: int = opt(DEFAULT_MAX_QUEUE, "waiting requests per instance before rejection (as serve)")
    overload_rules: bool = opt(True, "dilaserve: the overload rules (late requests take one slot by starvation, "
                                     "ride along only when at most 10 percent dearer, the shortest first; "
                                     "docs/scheduling.md); --no-overload-rules turns them off")
    preempt_at_risk: bool = opt(False, "dilaserve, under trial: a request in time takes the slot of a running one "
                                       "at risk (docs/scheduling.md)")
    run_ahead: bool = opt(False, "dilaserve, under trial: a request that cannot join the running ones is in time "
                                 "if it can run first and they all still make it (docs/scheduling.md)")
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    max_accuracy_drop: float | None = opt(1.0, "dilaserve: the serving accuracy budget, mean predicted drop vs "
                                               "τ_max in points, or none (unbounded)",
                                          parse=or_none(float, "none", "unbounded", "inf"))
    budget_mode: str = opt("adaptive", "budget mode, as serve's", choices=BUDGET_MODES)
    compile_cache: str = opt("by-degree", "auto: what a switch compiles. by-degree: a GPU with serve's persistent "
                                          "compile cache (JAX keys a GPU executable without its devices, so a TP "
                                          "degree compiled once loads for every placement; serve compiles every "
                                          "candidate degree before ready). per-placement: each placement never "
                                          "built compiles (--compile-s each)", choices=COMPILE_CACHES)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.devices < 1 or self.slots < 1:
            raise ValueError("devices and slots must be >= 1")
        bad = set(self.ablate) - set(ABLATIONS)
        if bad:
            raise ValueError(f"unknown ablations {sorted(bad)}; choose from {', '.join(ABLATIONS)}")
        if self.policy != "dilaserve" and (self.ablate or self.layout == "auto"):
            raise ValueError(f"{self.policy} runs on a fixed --layout (e.g. 2x4) and takes no --ablate")
        if self.compile_cache not in COMPILE_CACHES:
            raise ValueError(f"compile cache must be one of {COMPILE_CACHES}, got {self.compile_cache!r}")
        if self.budget_mode not in BUDGET_MODES:
            raise ValueError(f"budget mode must be one of {BUDGET_MODES}, got {self.budget_mode!r}")
        if self.max_accuracy_drop is not None and not self.max_accuracy_drop >= 0:
            raise ValueError(f"max_accuracy_drop must be >= 0 points (or None), got {self.max_accuracy_drop}")
        if not 0 < self.tau_min <= self.tau_max <= 1 or not 0 < self.static_tau <= 1:
            raise ValueError("need 0 < tau_min <= tau_max <= 1 and static_tau in (0, 1]")
        scheduled = [lay for _, lay in parse_schedule(self.layout)] if is_schedule(self.layout) else [self.layout]
        for spec in (*scheduled, self.initial_layout, *self.layouts):
            if spec not in (None, "auto") and sum(parse_layout(spec)) != self.devices:
                raise ValueError(f"layout {spec} does not cover {self.devices} devices")

    @property
    def name(self) -> str:
        extra = "".join(f" -{a}" for a in sorted(self.ablate))
        return f"{self.policy} {self.layout}{extra}"
