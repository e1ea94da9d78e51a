"""Feedback: the current layout's predictions checked against what it realises (pure; no JAX).

Only the layout being served can be checked, and the instances publish what it realises
(outcomes.py): which requests met their deadlines and how long they took.

**Attainment** (`checked_rate`; off by default, `ControllerConfig.feedback_min_requests`): when
the layout realises less than predicted beyond the tolerance and the noise, every layout is priced
at the rate where the current one's prediction falls to what it realised.

**Latency** (`LatencyMemory`; on by default, `ControllerConfig.latency_feedback_requests`). The
analytic chain's mean latencies are furthest off near a layout's capacity, and in both directions
(on the conversation-style mix at 9.5 req/s it predicted 4x2 at 1.21 s where it runs at 0.67 s,
and 1x8 at 0.74 s where it runs at 0.97 s; docs/simulation.md). Each round the ratio of what the
served layout realised (the mean latency of the requests that arrived since it began serving, over
the feedback window, and have finished) to what the chain predicts for it is smoothed into a
per-layout memory, with the arrival rate it was measured at. A layout's prediction is scaled by its
remembered ratio while the rate stays within `rate_tolerance` of that rate and for `memory_s`
after the last measurement; layouts never served at such a load keep the chain's figure. So a
layout that runs faster than predicted is kept, and one left because it ran slower than predicted
is not chosen again at the same load on the same optimistic figure. After a switch the new layout
inherits the old one's queue, and its first arrivals wait behind it (on the conversation mix at
14 req/s the 45 s after a switch realised 74-80% at 1.8x the predicted latency, then 99-100%), so a
layout is measured only on the requests that arrived once nothing in flight was past its deadline
(`since`).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

from dilaserve_jax.serving.policy.layout_eval import LayoutPrediction, evaluate_layouts

if TYPE_CHECKING:
    from dilaserve_jax.serving.policy.controller_config import ControllerConfig

RATIO_BOUNDS = (0.25, 4.0)  # a ratio beyond these says more about a transient than about the model


@dataclass(frozen=True, slots=True)
class Measured:
    ratio: float  # realised / predicted mean latency
    rate: float  # arrivals/s priced when it was measured
    time: float  # when it was last measured


class LatencyMemory:
    def __init__(self, *, min_requests: int, smoothing: float, rate_tolerance: float, memory_s: float) -> None:
        if min_requests < 0 or not 0 < smoothing <= 1 or rate_tolerance < 0 or memory_s < 0:
            raise ValueError("min requests >= 0, smoothing in (0, 1], rate tolerance >= 0, memory >= 0 s")
        self.min_requests, self.smoothing = min_requests, smoothing
        self.rate_tolerance, self.memory_s = rate_tolerance, memory_s
        self.measured: dict[tuple[int, ...], Measured] = {}
        self._clear_from: float | None = None  # since a switch: the first round with nothing overdue

    def switched(self) -> None:
        self._clear_from = None

    def since(self, now: float, start: float, in_flight_slack: Sequence[float]) -> float | None:
        """From when the served layout's finished requests count (at least `start`), or None while
        requests are still past their deadline since the last switch (a backlog it inherited)."""
        if self._clear_from is None:
            if any(s < 0 for s in in_flight_slack):
                return None
            self._clear_from = now
        return max(start, self._clear_from)

    def _applies(self, m: Measured, rate: float, now: float) -> bool:
        return now - m.time <= self.memory_s and abs(rate - m.rate) <= self.rate_tolerance * max(m.rate, 1e-9)

    def observe(self, layout: tuple[int, ...], now: float, rate: float, predicted_s: float,
                realised: tuple[float, int] | None) -> Measured | None:
        """Fold one round's (mean latency, count) the served `layout` realised into its memory;
        returns the layout's measurement when it has one that applies now."""
        if self.min_requests and realised is not None and realised[1] >= self.min_requests \
                and predicted_s > 0 and math.isfinite(predicted_s) and realised[0] > 0:
            obs = min(RATIO_BOUNDS[1], max(RATIO_BOUNDS[0], realised[0] / predicted_s))
            old = self.measured.get(layout)
            if old is not None and self._applies(old, rate, now):
                obs = old.ratio + self.smoothing * (obs - old.ratio)
            self.measured[layout] = Measured(obs, rate, now)
        return self.get(layout, rate, now)

    def get(self, layout: tuple[int, ...], rate: float, now: float) -> Measured | None:
        m = self.measured.get(layout)
        return m if m is not None and self._applies(m, rate, now) else None

    def correct(self, preds: Mapping[tuple[int, ...], LayoutPrediction], rate: float,
                now: float) -> dict[tuple[int, ...], LayoutPrediction]:
        """The predictions with each remembered layout's mean latency scaled by its ratio."""
        if not self.measured:  # (every round, over every candidate: nothing to copy)
            return dict(preds)
        out = {}
        for layout, p in preds.items():
            m = self.get(layout, rate, now)
            out[layout] = p if m is None else dataclasses.replace(p, latency_s=p.latency_s * m.ratio)
        return out


def checked_rate(cfg: "ControllerConfig", current: tuple[int, ...], curves: Mapping, rate: float,
                 realised: tuple[int, int] | None,
                 spread: Sequence[tuple[float, float]] | None = None) -> tuple[float, float | None]:
    """(the rate to price every layout at, the realised attainment when it was checked): the
    arrival rate, or, when the current layout realises less than predicted there beyond the
    tolerance and the noise, the rate at which its prediction falls to what it realised (the
    load it behaves as if it had: a backlog, or a model that prices its steps too cheaply)."""
    if realised is None or not realised[1]:
        return rate, None
    met, n = realised
    got = met / n  # recorded with the decision either way
    if not cfg.feedback_min_requests or n < cfg.feedback_min_requests:
        return rate, got
    noise = 2.0 * (max(got * (1.0 - got), 0.05 * 0.95) / n) ** 0.5

    def att(r: float) -> float:
        return evaluate_layouts([current], curves, r, spread=spread)[0].attainment

    if rate <= 0 or got >= att(rate) - max(cfg.feedback_tolerance, noise):
        return rate, got
    lo, hi = rate, rate * cfg.feedback_max_scale
    if att(hi) > got:
        return hi, got
    for _ in range(12):  # to 1/4096 of the bracket
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if att(mid) > got else (lo, mid)
    return hi, got
