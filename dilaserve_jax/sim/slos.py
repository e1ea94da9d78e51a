"""Per-request SLOs for a simulated workload: fixed, or a multiple of the request's latency alone
on an idle instance of a given TP degree (see `workload.parse_slo`)."""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from dilaserve_jax.core.kinds import StepKind
from dilaserve_jax.sim.executor import StepTimeModel, advance
from dilaserve_jax.sim.quality import Progress, QualityModel, RequestPlan, make_plan
from dilaserve_jax.sim.workload import RequestSpec


def idle_latency(spec: RequestSpec, plan: RequestPlan, quality: QualityModel, step_time: StepTimeModel,
                 tau: float, tp: int) -> float:
    """Seconds to serve the request alone on an idle TP-`tp` instance at a constant τ (no noise)."""
    canvas = len(spec.prompt_tokens) + spec.answer_length
    prog = Progress()
    total, refresh = 0.0, True
    for _ in range(spec.answer_length + 1):
        kind = StepKind.REFRESH if refresh else StepKind.REUSE
        total += step_time.mean(kind, 1, canvas, spec.block_length, tp)
        _, _, refresh, finished = advance(quality, plan, prog, tau)
        if finished:
            break
    return total


def assign_slos(specs: Sequence[RequestSpec], slo: tuple[str, tuple[float, ...]], *, quality: QualityModel,
                step_time: StepTimeModel, tau: float, tp: int, seed: int) -> list[RequestSpec]:
    """Each spec with its SLO (see workload.parse_slo): fixed, or uniform(LO, HI) × idle latency."""
    kind, vals = slo
    rng = np.random.default_rng([seed, 17])
    out = []
    for i, s in enumerate(specs):
        if kind == "fixed":
            out.append(replace(s, slo=vals[0]))
            continue
        plan = make_plan(quality, i + 1, s.task, s.answer_length, s.block_length, s.finish_tokens, s.prompt_tokens)
        idle = idle_latency(s, plan, quality, step_time, tau, tp)
        out.append(replace(s, slo=float(rng.uniform(*vals)) * idle))
    return out
