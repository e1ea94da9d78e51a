"""The threshold controller's configuration (the τ grid, the tokens-per-step prior, the quality
budget, the planning depth) and its online tokens-per-step estimate (pure Python; no JAX)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from dilaserve_jax.serving.policy.accuracy import interpolate
from dilaserve_jax.serving.policy.eval_rows import prior_from_eval_json, read_eval_rows
from dilaserve_jax.serving.policy.quality import QualityConfig

TAU_GRID: tuple[float, ...] = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.6, 0.5, 0.4, 0.3)
# Tokens committed per step at each τ for a 32-token block (τ = 1.0 commits only the argmax, since
# the commit rule is strict conf > τ). A placeholder until replaced by the measured prior.
DEFAULT_PRIOR: Mapping[float, float] = {1.0: 1.0, 0.95: 1.6, 0.9: 2.0, 0.8: 2.6, 0.7: 3.2, 0.6: 3.9,
                                        0.5: 4.7, 0.4: 5.6, 0.3: 6.8}


@dataclass(frozen=True, slots=True)
class ThresholdConfig:
    grid: tuple[float, ...] = TAU_GRID
    prior: tuple[tuple[float, float], ...] = tuple(DEFAULT_PRIOR.items())
    ema: float = 0.1  # weight of a new observation in the per-τ estimate
    request_ema: float = 0.3  # weight of a new observation in a request's speed ratio
    safety: float = 1.05  # predicted times are multiplied by this margin
    # share of the others' refresh steps that run in the same batch as one's own (requests admitted
    # together stay in phase, since every request needing a refresh joins the refresh batch)
    refresh_alignment: float = 0.5
    quality: QualityConfig | None = None  # accuracy model and loss budget; None: τ anywhere in [τ_min, τ_max]
    # queued requests planned per round, in deadline order, as a multiple of the slots: the rest
    # cannot start before these finish, so planning them each round only costs time at deep queues
    plan_depth: int = 4
    # arrival pressure: when at least this share of the requests planned over the last
    # `pressure_window_s` were at risk, deadlines are being lost to load, and every request is asked
    # to run at the budget's fixed floor — granted after every deadline's ask, cheapest first, so
    # only what the budget has left buys speed for the arrivals behind (None: off; off without a budget)
    pressure_at_risk_share: float | None = 0.05
    pressure_window_s: float = 20.0

    def __post_init__(self) -> None:
        if not self.grid or any(not 0 < t <= 1 for t in self.grid):
            raise ValueError(f"τ grid must be non-empty and in (0, 1]: {self.grid}")
        if list(self.grid) != sorted(self.grid, reverse=True) or len(set(self.grid)) != len(self.grid):
            raise ValueError("τ grid must be strictly descending")
        if not self.prior or any(v < 1.0 for _, v in self.prior):
            raise ValueError("prior tokens/step must be >= 1 (at least the argmax commits)")
        if self.plan_depth < 1:
            raise ValueError("plan_depth must be >= 1")
        if self.pressure_at_risk_share is not None and not 0 <= self.pressure_at_risk_share <= 1 \
                or not self.pressure_window_s > 0:
            raise ValueError("pressure share must be in [0, 1] (or None: off), its window > 0 seconds")
        if not 0 <= self.refresh_alignment <= 1:
            raise ValueError("refresh_alignment must be in [0, 1]")
        if not (0 < self.ema <= 1 and 0 < self.request_ema <= 1 and self.safety >= 1):
            raise ValueError("ema weights must be in (0, 1], safety >= 1")

    @classmethod
    def with_prior(cls, prior: Mapping[float, float], **kw) -> "ThresholdConfig":
        return cls(prior=tuple(sorted(((float(t), float(v)) for t, v in prior.items()), reverse=True)), **kw)

    @classmethod
    def from_eval(cls, path_or_rows, max_accuracy_drop: float | None = 1.0, budget_mode: str = "adaptive",
                  reference_tau: float | None = None, **kw) -> "ThresholdConfig":
        """Speed prior and accuracy model from the same eval rows, with a loss budget in points
        measured from `reference_tau` (None: from each request's own τ_max)."""
        rows = read_eval_rows(path_or_rows)
        quality = QualityConfig.from_eval(rows, max_accuracy_drop=max_accuracy_drop, mode=budget_mode,
                                          reference_tau=reference_tau)
        return cls.with_prior(prior_from_eval_json(rows), quality=quality, **kw)


class TokensPerStep:
    """Online tokens-committed-per-step estimate per τ bucket (buckets = the τ grid)."""

    def __init__(self, cfg: ThresholdConfig) -> None:
        self.cfg = cfg
        pts = sorted(cfg.prior)  # ascending τ
        self._rates = [interpolate(t, pts) for t in cfg.grid]
        self.counts = [0] * len(cfg.grid)
        self._mono: list[tuple[float, float]] | None = None  # monotone envelope, ascending τ (cached)
        self._memo: dict[float, float] = {}  # τ -> rate until the next observation (plans ask many times)

    def bucket(self, tau: float) -> int:
        return min(range(len(self.cfg.grid)), key=lambda i: abs(self.cfg.grid[i] - tau))

    def observe(self, tau: float, n_committed: int) -> None:
        i = self.bucket(tau)
        self._rates[i] += self.cfg.ema * (n_committed - self._rates[i])
        self.counts[i] += 1
        self._mono = None
        self._memo.clear()

    def rate(self, tau: float) -> float:
        """Interpolated, and monotone: a lower τ never predicts fewer tokens than a higher one."""
        out = self._memo.get(tau)
        if out is None:
            if self._mono is None:
                mono, best = [], 0.0
                for r in self._rates:  # grid descends in τ
                    best = max(best, r)
                    mono.append(best)
                self._mono = sorted(zip(self.cfg.grid, mono))
            out = self._memo[tau] = max(1.0, interpolate(tau, self._mono))
        return out

    def snapshot(self) -> dict[float, float]:
        return {t: round(self.rate(t), 4) for t in self.cfg.grid}
