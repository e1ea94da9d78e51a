"""The policies benchmark's configuration: `BenchConfig`, whose fields are `bench.policies`' flags
(the workload, the instance and the sweep), and `ShippedDefaults`, what serve runs with unflagged
(resolved by `Bench.shipped`)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from dilaserve_jax.core.cli import opt, or_none
from dilaserve_jax.kernels import IMPLEMENTATIONS
from dilaserve_jax.serving.policy.scheduler import ADMISSION_MODES

DEFAULT_BUDGETS = (0.0, 0.5, 1.0, 2.0, 5.0, None)  # points; None: unbounded
CLOCKS = ("real", "modeled")


def budget_label(budget: float | None) -> str:
    return "inf" if budget is None else f"{budget:g}"


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """The workload, the instance and the sweep of one benchmark (`bench.policies`' flags)."""

    model: str = opt("tiny", "preset or checkpoint directory")
    attention: str = opt("auto", "attention implementation (auto = Pallas on GPU/TPU, XLA on CPU)",
                         choices=IMPLEMENTATIONS)
    rates: tuple[float, ...] = opt((), "request rates in req/s",
                                   default_text="--load-factors times the measured capacity")
    load_factors: tuple[float, ...] = opt((0.3, 0.7, 1.2, 2.0), "rates as multiples of the measured capacity")
    duration: float = opt(10.0, "seconds of arrivals per trace")
    traces: int = opt(1, "Poisson traces per rate (different seeds); every run serves all of them, pooled: more "
                         "requests per point")
    slo_range: tuple[float, float] = opt((2.0, 6.0), "SLO = uniform(LO, HI) x the request's idle latency at the "
                                                     "static τ", metavar=("LO", "HI"))
    slo_factor: float | None = opt(None, "SLO = F x the median idle latency of the request's task at the static τ "
                                         "(instead of --slo-range)", metavar="F")
    trace: str | None = opt(None, "arrivals and answer lengths from windows of this trace CSV (TIMESTAMP, "
                                  "ContextTokens, GeneratedTokens), scaled in time to each rate; a row with at most 12 "
                                  "generated tokens becomes a 12-token task, a longer one a 96-token task",
                            metavar="CSV", default_text="Poisson arrivals over the whole pool")
    trace_min_generated: int = opt(0, "use only the trace's rows with at least N generated tokens", metavar="N")
    slots: int = opt(8, "slots of the instance")
    per_task: int = opt(20, "held-out problems per task in the pool")
    pool_skip: int = opt(100, "skip the first N held-out problems per task, the eval rows' sample", metavar="N")
    tau_min: float = opt(0.6, "dilaserve quality floor of the budget sweep")
    tau_max: float = opt(0.9, "dilaserve ceiling of the budget sweep")
    admission: str = opt("best-effort", "admission of the budget sweep's dilaserve runs: best-effort serves a "
                                        "request that cannot meet its deadline late, strict refuses it",
                         choices=ADMISSION_MODES)
    defaults_row: bool = opt(True, "also run dilaserve exactly as serve ships it (its τ floor, the eval rows' "
                                   "accuracy plateau as ceiling, its budget measured from that ceiling, its admission)")
    static_tau: float = 0.9  # the static policies' τ and the per-prompt reference's; not a flag
    budgets: tuple[float | None, ...] = opt(
        DEFAULT_BUDGETS, "dilaserve accuracy-loss budgets to sweep, points vs τ_max, 'inf' = unbounded",
        name="--max-accuracy-drop", parse=or_none(float, "inf", "none", "unbounded"), nargs="+", metavar="PTS",
        default_text=" ".join(map(budget_label, DEFAULT_BUDGETS)))
    floor_baseline: bool = opt(True, "also run the fixed-floor baseline (lowest τ within budget for everyone) at the "
                                     "finite positive budgets")
    prior: str | None = opt(None, "eval --json rows: the τ -> tokens/step and τ -> accuracy priors",
                            default_text="the model directory's eval.json, if present")
    profile: str | None = opt(None, "latency profile JSON for the schedulers and the modeled clock",
                              default_text="measured at start")
    profile_passes: int = opt(3, "profile passes; each shape keeps its fastest (other jobs only slow steps down)")
    save_profile: str | None = opt(None, "write the profile measured at start-up (rerun with --profile PATH --clock "
                                         "modeled to repeat a run exactly)", metavar="PATH")
    seed: int = opt(0, "workload seed")
    clock: str = opt("real", "real: serve in real time; modeled: real steps, virtual clock advanced by each step's "
                             "profiled time (reproducible, untouched by other load; scheduling time not counted)",
                     choices=CLOCKS)

    def __post_init__(self):
        if self.clock not in CLOCKS:
            raise ValueError(f"clock must be one of {CLOCKS}, got {self.clock!r}")
        if (self.duration <= 0 or self.slots < 1 or self.per_task < 1 or self.pool_skip < 0 or self.profile_passes < 1
                or self.traces < 1):
            raise ValueError("duration, slots, per_task, profile_passes and traces must be positive, pool_skip >= 0")
        if not (0 < self.slo_range[0] <= self.slo_range[1]):
            raise ValueError(f"bad SLO range {self.slo_range}")
        if self.slo_factor is not None and not self.slo_factor > 0:
            raise ValueError(f"the SLO factor must be positive, got {self.slo_factor}")
        if self.trace_min_generated < 0:
            raise ValueError(f"trace_min_generated must be >= 0, got {self.trace_min_generated}")
        if self.admission not in ADMISSION_MODES:
            raise ValueError(f"admission must be one of {ADMISSION_MODES}, got {self.admission!r}")
        if any(r <= 0 for r in self.rates) or any(f <= 0 for f in self.load_factors):
            raise ValueError("rates and load factors must be positive")
        if not (self.rates or self.load_factors):
            raise ValueError("need rates or load factors")
        if not 0 < self.tau_min <= self.tau_max <= 1 or not 0 < self.static_tau <= 1:
            raise ValueError("need 0 < tau_min <= tau_max <= 1 and static_tau in (0, 1]")
        if not self.budgets or any(b is not None and not (0 <= b < math.inf) for b in self.budgets):
            raise ValueError(f"budgets must be points >= 0 (or unbounded), got {self.budgets}")
        object.__setattr__(self, "budgets", tuple(dict.fromkeys(self.budgets)))  # a budget given twice runs once

    def runs(self, floor_of=None, shipped: "ShippedDefaults | None" = None) -> list[tuple[str, float | None, str]]:
        """(policy, budget, mode) of every run at one rate: the static policies, serve's defaults
        (mode "defaults", with `--defaults-row` and `shipped`), then the sweep. The fixed floor runs only
        at the budgets whose floor lies below the budget-0 floor (`floor_of(budget) -> τ`); elsewhere it
        is the budget-0 policy."""
        out = [("fcfs-static", None, "-"), ("edf-static", None, "-")]
        if self.defaults_row and shipped is not None:
            out.append((shipped.policy, shipped.budget, "defaults"))
        out += [("dilaserve", b, "adaptive") for b in self.budgets]
        if self.floor_baseline:
            out += [("dilaserve", b, "floor") for b in self.budgets if b is not None and b > 0
                    and (floor_of is None or floor_of(b) < floor_of(0.0))]
        return out


@dataclass(frozen=True, slots=True)
class ShippedDefaults:
    """What `serve` runs with when given no flags (read from `ServeConfig` and resolved as serve does)."""

    policy: str
    tau_min: float
    tau_max: float  # the τ ceiling: the eval rows' accuracy plateau
    budget: float | None  # points, measured from the ceiling
    budget_mode: str
    admission: str
    threshold: object  # its ThresholdConfig
