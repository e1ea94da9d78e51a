"""The arrival rate over the controller's window, and whether it is still moving (pure)."""
from __future__ import annotations

from typing import Sequence


def rate_since(times: Sequence[float], now: float, span: float) -> float:
    """Arrivals per second over the last `span` seconds."""
    return sum(1 for t in times if t >= now - span) / span


def load_moved(times: Sequence[float], now: float, span: float, tol: float) -> tuple[float, float] | None:
    """(rate over the last half of `span`, rate over `span`) when they differ by more than `tol` of
    the larger and by more than 3 Poisson standard deviations of the half's rate; else None."""
    whole, recent = rate_since(times, now, span), rate_since(times, now, span / 2)
    diff = abs(recent - whole)
    noise = 3.0 * (max(whole, 1e-9) / (span / 2)) ** 0.5
    return (recent, whole) if diff > tol * max(recent, whole) and diff > noise else None
