"""The systems the simulator compares, built from the serving policy objects, and their ablations.

fcfs-static / edf-static: the scheduler's static policies on a fixed layout, τ fixed (0.9).
dilaserve: least-slack scheduling with per-request τ and load control (`serving.policy.threshold`), the
cluster controller choosing the layout (`--layout auto`) and moving at-risk requests. Ablations
(`--ablate`, any combination) switch one mechanism off and leave the rest as they are:

  threshold  no per-request τ: every request runs at the τ load control sets for the instance
             (the system cap; its own range still clamps it)
  load       no load control: the system-wide cap stays at 1.0; each request still picks the
             highest τ that meets its own deadline
  reconfig   the layout never changes (the controller may only migrate)
  migration  no at-risk migration (the controller may only reconfigure)

The two τ ablations are thin subclasses of `ThresholdController` that change only how its cap is
chosen or applied; everything else is the serving code unchanged.
"""
from __future__ import annotations

from dilaserve_jax.serving.policy.threshold import ThresholdController

ABLATIONS = ("threshold", "load", "reconfig", "migration")


class NoLoadControl(ThresholdController):
    """Load control off: the system-wide τ cap is pinned at 1.0."""

    def _solve(self, active, fracs, excluded, now, num_slots, free, step_time):
        cands = self._plan_candidates(active, fracs, excluded, num_slots, step_time, self.candidates)
        return 1.0, self._pass(cands, now, free, 1.0)


class UniformTau(ThresholdController):
    """Per-request τ off: every request runs at the cap load control chooses (within its range)."""

    def _solve(self, active, fracs, excluded, now, num_slots, free, step_time):
        cap, best = super()._solve(active, fracs, excluded, now, num_slots, free, step_time)
        reqs = {r.id: r for r, _ in active}
        return cap, {rid: d._replace(tau=min(reqs[rid].tau_max, max(reqs[rid].tau_min, cap)))
                     for rid, d in best.items()}


def threshold_controller_class(ablate: frozenset[str]) -> type[ThresholdController]:
    if {"threshold", "load"} <= ablate:
        return _FixedAtTauMax
    if "load" in ablate:
        return NoLoadControl
    if "threshold" in ablate:
        return UniformTau
    return ThresholdController


class _FixedAtTauMax(ThresholdController):
    """Both τ mechanisms off: every request at its τ_max (least-slack scheduling stays)."""

    def _solve(self, active, fracs, excluded, now, num_slots, free, step_time):
        cap, best = NoLoadControl._solve(self, active, fracs, excluded, now, num_slots, free, step_time)
        reqs = {r.id: r for r, _ in active}
        return cap, {rid: d._replace(tau=reqs[rid].tau_max) for rid, d in best.items()}


__all__ = ["ABLATIONS", "NoLoadControl", "UniformTau", "threshold_controller_class"]
