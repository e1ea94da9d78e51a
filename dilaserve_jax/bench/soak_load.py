"""The load of `bench.soak`: open-loop phases of Poisson arrivals and the synthetic multi-TP
profile that gives a live controller on fake CPU devices a reason to switch layouts."""
from __future__ import annotations

import argparse

SYNTHETIC_TP = "synthetic-tp"
# The synthetic profile's steps are this many times the fake runner's default step time, which puts
# the load where narrower layouts start to win (the documented soak's busy phase: 10 req/s of 12-token
# answers at a 2.5 s SLO) below what this in-process client and server sustain on two CPU cores
# (about 14 calls/s).
SYNTHETIC_TP_SCALE = 400.0


def parse_phases(text: str) -> tuple[tuple[float, float], ...]:
    """"2:60,30:60" -> ((2.0, 60.0), (30.0, 60.0)): (arrivals per second, seconds) per phase; the
    simulator's `steps:RATE@SECONDS,...` pattern (sim/workload.py) written with colons."""
    from dilaserve_jax.sim.workload import parse_steps

    try:
        steps = parse_steps("steps:" + text.replace(":", "@"))
    except ValueError:
        steps = None
    if not steps or any(rate <= 0 for rate, _ in steps):
        raise argparse.ArgumentTypeError(f"{text!r}: need RATE:SECONDS,... with every rate and duration "
                                         "positive, e.g. 1:60,10:60")
    return tuple(steps)


def poisson_arrivals(phases, seed: int) -> list[float]:
    """Arrival times (s from the start) of a Poisson process whose rate is constant within each phase."""
    import numpy as np

    from dilaserve_jax.sim.workload import arrival_times

    spec = "steps:" + ",".join(f"{rate!r}@{seconds!r}" for rate, seconds in phases)
    return arrival_times(spec, duration=None, rate_scale=1.0, rng=np.random.default_rng(seed)).tolist()


def synthetic_tp_profile(scale: float = SYNTHETIC_TP_SCALE, tps=(1, 2, 4, 8)):
    """The fake runner's multi-TP profile (`fake_runner.tp_step_time`: a TP-t step is the parallel
    part of a TP-1 step divided by t, a serial share that is not, plus an all-reduce), every step
    `scale` times longer. Wide instances finish one request sooner, many narrow ones serve more in
    all, as on a GPU. Labelled synthetic; it only steers the controller and the schedulers' plans."""
    from dilaserve_jax.core.kinds import StepKind
    from dilaserve_jax.serving.cluster.fake_runner import default_step_time, fake_tp_profile
    from dilaserve_jax.serving.policy.latency import Profile

    def base(kind: StepKind, batch: int, canvas: int, block: int) -> float:
        return scale * default_step_time(kind, batch, canvas, block)

    p = fake_tp_profile(tps, base=base)
    return Profile(f"synthetic multi-TP profile, fake runner steps x{scale:g} (not measured)", True, "synthetic",
                   "synthetic", p.points)
