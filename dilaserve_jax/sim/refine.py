"""Refinement by replay: the cluster controller's shortlist priced by simulating it.

The controller's analytic chain (`serving/policy/capacity.py`) ranks every candidate layout in
milliseconds but is off by 5-10% of a layout's capacity at its edge, which is where the choice
matters. `ReplayRefiner` replays the arrivals of the last few seconds on each shortlisted layout,
held fixed, under the same per-instance policy (a child `Simulation` from empty instances), and
returns what each realises: model-predictive control on the simulator's own event loop. The
replayed requests are the window's arrivals as they came (prompts, answer areas and where their
answers end: a live server knows these for the requests it finished and would estimate them for the
rest); the first `refine_warmup` share of the window only fills the instances and is not counted.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Sequence

from dilaserve_jax.core.layouts import layout_text
from dilaserve_jax.serving.policy.capacity import RequestShape
from dilaserve_jax.serving.policy.layout_eval import LayoutPrediction

if TYPE_CHECKING:
    from dilaserve_jax.sim.simulator import Simulation


class ReplayRefiner:
    """The refiner `serving/policy/refinement.Refinement` calls, refiner(layouts, [(arrival, shape)],
    now), over `sim`'s requests (matched by arrival time) and models."""

    def __init__(self, sim: "Simulation") -> None:
        self.sim = sim
        self._by_arrival = {s.arrival: s for s in sim.specs}
        self.replays = 0

    def __call__(self, layouts: Sequence[tuple[int, ...]], arrivals: Sequence[tuple[float, RequestShape]],
                 now: float) -> list[LayoutPrediction]:
        from dilaserve_jax.sim.simulator import Simulation

        start = arrivals[0][0]
        specs = [replace(self._by_arrival[t], arrival=t - start) for t, _ in arrivals if t in self._by_arrival]
        if len(specs) != len(arrivals):  # the controller saw arrivals this run did not make
            raise RuntimeError(f"{len(arrivals) - len(specs)} of {len(arrivals)} arrivals to replay are not requests "
                               f"of this simulation")
        counted_from = (now - start) * self.sim.cfg.controller.refine_warmup
        out = []
        for layout in layouts:
            cfg = replace(self.sim.cfg, layout=layout_text(layout), initial_layout=None)
            child = Simulation(cfg, specs, step_time=self.sim.step_time, latency=self.sim.latency,
                               quality=self.sim.quality, prior=self.sim.prior, param_bytes=self.sim.param_bytes,
                               host_time=self.sim.host_time)
            child._tcfg, child._tclass = self.sim._tcfg, self.sim._tclass  # the parent's instance policy as it is
            recs = [r for r in child.run().records if r.arrival >= counted_from]
            self.replays += 1
            if not recs:
                out.append(LayoutPrediction(layout, 1.0, 0.0, cfg.tau_max))
                continue
            done = [r for r in recs if r.latency is not None]
            lat = sum(r.latency for r in done) / len(done) if done else float("inf")
            taus = [r.tau_sum / r.steps for r in recs if r.steps]
            out.append(LayoutPrediction(layout, sum(r.met for r in recs) / len(recs), lat,
                                        sum(taus) / len(taus) if taus else cfg.tau_max))
        return out
