"""What a request's remaining work costs: steps left at a τ and the wall time they take.

Steps left are counted at the request's own tokens per step (the shared estimate `TokensPerStep`
times its speed ratio); each block costs one refresh (the current block's only if still due) and
reuse steps for the rest. The time prices each own step at the batch it runs in, plus the wait for
the other requests' batch of the other kind (refresh and reuse steps run as separate batches).
Prices are memoised until an estimate changes: steps left with the range of rates they hold for,
times per (request state, τ, batch), step times per shape and batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from dilaserve_jax.core.kinds import StepKind
from dilaserve_jax.serving.policy.request import Request, steps_left
from dilaserve_jax.serving.policy.step_time import ScaledStepTime, StepTime
from dilaserve_jax.serving.policy.threshold_config import ThresholdConfig, TokensPerStep

_REFRESH, _REUSE = StepKind.REFRESH, StepKind.REUSE


@dataclass(slots=True)
class StepPricing:
    """Prices remaining steps and time; the threshold controller plans with them."""
    cfg: ThresholdConfig = field(default_factory=ThresholdConfig)
    tps: TokensPerStep = None  # type: ignore[assignment]
    ratios: dict[str, float] = field(default_factory=dict)  # per-request speed vs the average
    mean_refresh_fraction: float = 0.0  # share of remaining steps that are refreshes, active requests
    # prices until an estimate changes (`invalidate`): keys carry the request's block state and ratio
    _steps_memo: dict[str, tuple[tuple, dict[float, tuple[float, float, tuple[int, int]]]]] = \
        field(default_factory=dict)  # id -> (its block state, τ -> (valid for rates in lo..hi, steps))
    _time_memo: dict[tuple, float] = field(default_factory=dict)
    _cost_memo: dict[tuple, tuple[float, float, float]] = field(default_factory=dict)  # step times per shape
    _priced_with: StepTime | None = None  # the step-time function _time_memo holds prices of
    _scaled: bool = False  # it is a ScaledStepTime: _cost_memo holds its base times, unscaled

    def __post_init__(self) -> None:
        if self.tps is None:
            self.tps = TokensPerStep(self.cfg)

    def rescaled(self) -> None:
        """The step-time function's correction (`ScaledStepTime.scales`) changed: drop the times
        priced with it (the base times stay when they are kept apart from it)."""
        self._time_memo.clear()
        if not self._scaled:
            self._cost_memo.clear()

    def invalidate(self) -> None:
        """The caller's step-time estimate changed: drop memoised times (steps left are memoised
        with the rates they hold for, so they stay; a change of the rates alone clears only the
        remaining times, which `_time_memo` holds)."""
        self._time_memo.clear()
        self._cost_memo.clear()

    def steps_needed(self, req: Request, tau: float) -> tuple[int, int]:
        """(refresh steps, reuse steps) to finish at τ, at this request's own tokens per step.

        Memoised with the range of tokens per step the answer holds for (the counts are ceilings
        of the masked tokens over it), so the estimates' small moves between steps price nothing."""
        x = self.tps.rate(tau) * self.ratios.get(req.id, 1.0)
        if not x > 1.0:  # max(1.0, x) (the builtin costs several times more; this runs hundreds of times a round)
            x = 1.0
        state = (req.block_index, req.block_committed, req.needs_refresh)
        memo = self._steps_memo.get(req.id)
        if memo is None or memo[0] != state:
            memo = self._steps_memo[req.id] = (state, {})
        hit = memo[1].get(tau)
        if hit is not None and hit[0] < x < hit[1]:
            return hit[2]
        out = self._count_steps(req, x)
        if req.blocks_left == 0:
            lo, hi = -math.inf, math.inf
        else:
            lo1, hi1 = _ceiling_range(req.masked_in_block, x)
            lo2, hi2 = _ceiling_range(req.block_length, x)
            lo, hi = (lo1 if lo1 > lo2 else lo2), (hi1 if hi1 < hi2 else hi2)
        memo[1][tau] = (lo, hi, out)
        return out

    @staticmethod
    def _count_steps(req: Request, tokens_per_step: float) -> tuple[int, int]:
        return steps_left(req, tokens_per_step)

    def refresh_fraction(self, req: Request, tau: float) -> float:
        n_ref, n_reu = self.steps_needed(req, tau)
        return n_ref / (n_ref + n_reu) if n_ref + n_reu else 0.0

    def remaining_time(self, req: Request, tau: float, batch: int, step_time: StepTime,
                       others_refreshing: float | None = None) -> float:
        """Predicted wall time to finish at τ while sharing the instance with batch - 1 others.

        Refresh and reuse run as separate batches, so each of its steps also waits for the other
        kind's batch of the others: a reuse step waits for a refresh batch whenever one of the others
        needs one (expected `others_refreshing` of them per round), a refresh step for their reuse batch.
        """
        if others_refreshing is None:
            others_refreshing = (batch - 1) * self.mean_refresh_fraction
        self._pricing_with(step_time)
        key = (req.id, tau, batch, others_refreshing, self.ratios.get(req.id, 1.0), req.block_index,
               req.block_committed, req.needs_refresh)
        out = self._time_memo.get(key)
        if out is None:
            out = self._time_memo[key] = self._time_to_finish(req, tau, batch, step_time, others_refreshing)
        return out

    def _time_to_finish(self, req: Request, tau: float, batch: int, step_time: StepTime,
                        others_refreshing: float) -> float:
        n_ref, n_reu = self.steps_needed(req, tau)
        per_refresh, per_reuse = self._step_costs(req, batch, step_time, others_refreshing)
        return (n_ref * per_refresh + n_reu * per_reuse) * self.cfg.safety

    def _pricing_with(self, step_time: StepTime) -> None:
        if step_time is not self._priced_with and step_time != self._priced_with:  # another clock of steps
            self.invalidate()
            self._priced_with = step_time
            self._scaled = isinstance(step_time, ScaledStepTime)

    def _step_costs(self, req: Request, batch: int, step_time: StepTime,
                    others_refreshing: float) -> tuple[float, float]:
        """Seconds per own refresh and per own reuse step, the wait for the others' batches included.
        The step times are memoised per shape and batches (the request counts through its shape
        alone) until the step-time estimate changes; the waits are worked out per call."""
        self._pricing_with(step_time)
        k = math.ceil(others_refreshing)
        k = 1 if k < 1 else batch if k > batch else k  # the others' refresh batch
        key = (req.canvas_length, req.block_length, batch, k)
        times = self._cost_memo.get(key)
        if self._scaled:  # base times memoised, the correction applied as ScaledStepTime applies it
            if times is None:
                times = self._cost_memo[key] = self._price_step_costs(req, batch, k, step_time.base)
            scales = step_time.scales
            s_ref = scales[_REFRESH]
            t_ref, t_reu, t_ref_others = times[0] * s_ref, times[1] * scales[_REUSE], times[2] * s_ref
        else:
            if times is None:
                times = self._cost_memo[key] = self._price_step_costs(req, batch, k, step_time)
            t_ref, t_reu, t_ref_others = times
        wait_reuse = (1 - self.cfg.refresh_alignment) * (others_refreshing if others_refreshing < 1.0 else 1.0) \
            * t_ref_others
        wait_refresh = t_reu if batch > 1 else 0.0  # per own refresh step
        return t_ref + wait_refresh, t_reu + wait_reuse

    def _price_step_costs(self, req: Request, batch: int, others_batch: int,
                          step_time: StepTime) -> tuple[float, float, float]:
        """(own refresh, own reuse, the others' refresh batch) step times."""
        return (step_time(StepKind.REFRESH, batch, req), step_time(StepKind.REUSE, batch, req),
                step_time(StepKind.REFRESH, others_batch, req))


_MARGIN = 1e-9  # relative: a rate this close to a step of the ceiling is priced again, not trusted


def _ceiling_range(masked: int, x: float) -> tuple[float, float]:
    """The open range of rates (>= 1) around x over which max(1, ceil(masked / rate)) keeps its value."""
    k = math.ceil(masked / x)
    # rates are clamped to >= 1, so the lowest step (k = masked, at rate 1) reaches down to any rate
    lo = -math.inf if k >= masked else masked / k * (1 + _MARGIN)
    return lo, (math.inf if k <= 1 else masked / (k - 1) * (1 - _MARGIN))
