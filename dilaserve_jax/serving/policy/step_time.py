"""What the threshold controller prices steps with: a step-time function of (kind, batch, request)
that may look at the request's shape (canvas and block length) only, so prices are shared by
requests of one shape.

A scheduler's estimate is the latency model's round time times an online correction per kind,
and the correction moves after nearly every step. `ScaledStepTime` keeps the two apart, so the
controller can memoise the model's times and apply the current correction at lookup: the same
product, computed the same way, without pricing every shape again after every step.
"""
from __future__ import annotations

from typing import Callable, Mapping

from dilaserve_jax.core.kinds import StepKind
from dilaserve_jax.serving.policy.request import Request

StepTime = Callable[[StepKind, int, Request], float]


class ScaledStepTime:
    """`base(kind, batch, req) * scales[kind]`; `scales` is read live (its owner updates it in place)."""

    __slots__ = ("base", "scales")

    def __init__(self, base: StepTime, scales: Mapping[StepKind, float]) -> None:
        self.base, self.scales = base, scales

    def __call__(self, kind: StepKind, batch: int, req: Request) -> float:
        return self.base(kind, batch, req) * self.scales[kind]
