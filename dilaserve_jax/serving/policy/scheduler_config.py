"""The step scheduler's configuration: policy, slots, queue bound, admission, starvation and the
overload rules (pure Python; see serving/policy/scheduler.py for what each does)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from dilaserve_jax.serving.policy.request import Request
from dilaserve_jax.serving.policy.threshold import ThresholdConfig

POLICIES = ("fcfs-static", "edf-static", "dilaserve")
# the overload rules (SchedulerConfig's fields), on by default: what late requests may take from the
# requests still in time (docs/scheduling.md, "The overload rules"); preemption stays under trial
OVERLOAD_RULES = dict(starved_at_risk_slots=1, rider_cost=0.1, shortest_late_first=True)
OVERLOAD_RULES_OFF = dict(starved_at_risk_slots=None, rider_cost=math.inf, shortest_late_first=False)
ADMISSION_MODES = ("best-effort", "strict")
MAX_SKIP = 16
AT_RISK_SKIP_SHARE = 0.125
# the rounds with a free slot a late request waits at most before it goes first (the controller
# prices late requests' latency by it)
LATE_WAIT_ROUNDS = MAX_SKIP / AT_RISK_SKIP_SHARE


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    num_slots: int
    policy: str = "dilaserve"
    tp: int = 1  # TP degree of the instance (selects the latency fit)
    static_tau: float = 0.9  # τ of the static policies (clamped to each request's [τ_min, τ_max])
    max_queue: int = 256  # waiting requests beyond this are rejected
    max_batch: int | None = None  # default: num_slots
    max_skip: int = MAX_SKIP  # rounds a runnable request may be passed over before it goes first
    at_risk_skip_share: float = AT_RISK_SKIP_SHARE  # dilaserve: a skip of a request at risk counts this much (see module doc)
    admission: str = "best-effort"  # or "strict": refuse what cannot meet its deadline (see module doc)
    drop_expired: bool = False  # finish requests past their deadline as FINISHED_DEADLINE
    # under trial, off by default: near capacity it sends back requests that would still have finished
    preempt_at_risk: bool = False  # dilaserve: a request in time takes the slot of a running one at risk
    # the overload rules, on by default (OVERLOAD_RULES_OFF turns them off; docs/scheduling.md):
    starved_at_risk_slots: int | None = 1  # dilaserve: slots at-risk requests may take by starvation (None: all)
    rider_cost: float = 0.1  # dilaserve: an at-risk request joins a step with requests in time only
    #                          if it makes the step at most this much longer (inf: always)
    shortest_late_first: bool = True  # dilaserve: at-risk requests in order of work left, not slack
    run_ahead: bool = False  # dilaserve: a request that cannot join the others fits if it can run first
    #                          and they all still make it delayed by its time
    latency_ema: float = 0.2  # online correction of the latency model from measured step times
    # waiting requests priced again per published load when more wait (the rest keep their last
    # price; see `snapshot`), so publishing costs no more at a deep queue than at this one
    reprice_per_round: int = 16
    threshold: ThresholdConfig = field(default_factory=ThresholdConfig)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.admission not in ADMISSION_MODES:
            raise ValueError(f"admission must be one of {ADMISSION_MODES}, got {self.admission!r}")
        if self.num_slots < 1 or self.tp < 1 or self.max_queue < 0 or self.max_skip < 1 or self.reprice_per_round < 1:
            raise ValueError("num_slots, tp, max_skip, reprice_per_round must be >= 1 and max_queue >= 0")
        if self.max_batch is not None and self.max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if not 0 < self.at_risk_skip_share <= 1:
            raise ValueError("at_risk_skip_share must be in (0, 1]")
        if not 0 < self.static_tau <= 1 or not 0 <= self.latency_ema <= 1:
            raise ValueError("static_tau must be in (0, 1], latency_ema in [0, 1]")

    @property
    def adaptive(self) -> bool:
        return self.policy == "dilaserve"

    @property
    def batch_limit(self) -> int:
        return min(self.max_batch or self.num_slots, self.num_slots)

    def strict_for(self, req: Request) -> bool:
        """Whether `req` is refused when it cannot meet its deadline: its own ask, else the server's."""
        return req.strict_admission if req.strict_admission is not None else self.admission == "strict"


@dataclass(frozen=True, slots=True)
class AddResult:
    accepted: bool
    reason: str | None = None
