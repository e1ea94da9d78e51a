"""What a lower τ costs in answer quality: the accuracy model read from the eval rows, and the
plateau where accuracy stops growing with τ (pure Python; no JAX).

Accuracy model (`AccuracyModel`, from the eval rows that also give the speed prior):
  - the pooled curve τ → accuracy (correct / problems over every task's rows);
  - one risk profile per task: its own τ → accuracy curve, its answer area, and its first-step
    confidence signature (how its masked positions' confidences are spread at a request's first
    step, before anything is committed).
  Loss at τ relative to a reference τ_ref is in accuracy points and made monotone:
  loss(τ) = max(0, acc(τ_ref) − min acc over [τ, τ_ref]), so a measured bump below τ_ref is never
  counted as a gain.

Plateau (`plateau_tau`): the lowest τ whose accuracy is within the measured noise of the best τ's
(and every τ between them as well): accuracy gaps inside a z-interval of the two binomial
estimates are not told apart from zero. A ceiling above it buys no measurable accuracy for many
more steps, so it is serve's default τ ceiling.

A request's expected loss mixes the profiles' losses by a posterior (`AccuracyModel.posterior`):
the prior is every profile with the request's answer area (weighted by problems measured; all
profiles if none matches); the request's own first-step confidence histogram updates it
(multinomial likelihood against each signature, tempered because the positions of one request are
not independent).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

Curve = tuple[tuple[float, float], ...]  # (τ, accuracy in [0, 1]), ascending τ
PLATEAU_Z = 1.96  # a 95% interval


@dataclass(frozen=True, slots=True)
class Plateau:
    """The ceiling rule's answer, with what it rests on (for start-up logs and --help)."""

    tau: float  # the lowest τ within noise of the best (and every τ above it too)
    best_tau: float
    best_accuracy: float
    accuracy: float  # at `tau`
    z: float

    def describe(self) -> str:
        if self.tau == self.best_tau:
            return (f"τ {self.tau:g} is the most accurate measured ({100 * self.best_accuracy:.1f}%) and no lower τ "
                    f"is within its {self._interval} interval")
        return (f"the lowest τ whose accuracy ({100 * self.accuracy:.1f}%) is within the {self._interval} "
                f"interval of the best ({100 * self.best_accuracy:.1f}% at τ {self.best_tau:g})")

    @property
    def _interval(self) -> str:
        return "95%" if abs(self.z - 1.96) < 1e-9 else f"z={self.z:g}"


def plateau_tau(curve: Curve, samples: Mapping[float, float], z: float = PLATEAU_Z) -> Plateau:
    """The lowest τ such that it and every τ between it and the best τ measure an accuracy within z
    standard errors of the best's (the errors of the two binomial estimates combined; `samples`:
    problems per τ; a τ without a count is told apart from the best by any gap at all). Ties for
    the best go to the highest τ, so a bump further down (beyond a dip) is never the start."""
    if not curve:
        raise ValueError("no accuracy curve to find a plateau on")
    best_tau, best = max(curve, key=lambda p: (p[1], p[0]))
    n_best = samples.get(best_tau)
    var_best = best * (1 - best) / n_best if n_best else 0.0

    def within(t: float, a: float) -> bool:
        n = samples.get(t)
        return best - a <= z * math.sqrt(var_best + (a * (1 - a) / n if n else 0.0)) + 1e-12

    tau, acc = best_tau, best
    for t, a in sorted((p for p in curve if p[0] < best_tau), reverse=True):
        if not within(t, a):
            break
        tau, acc = t, a
    return Plateau(tau, best_tau, best, acc, z)


def interpolate(x: float, pts: Sequence[tuple[float, float]]) -> float:
    """Piecewise-linear through (x, y) points in ascending x, flat beyond the ends."""
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[-1][1]


def curve_loss(curve: Curve, tau: float, ref: float) -> float:
    """Accuracy points lost at τ relative to τ_ref, monotone (never negative, never lower at a lower τ)."""
    if tau >= ref:
        return 0.0
    inside = [a for t, a in curve if tau < t < ref]
    worst = min([interpolate(tau, curve), *inside])
    return max(0.0, 100.0 * (interpolate(ref, curve) - worst))


@dataclass(frozen=True, slots=True)
class RiskProfile:
    name: str
    weight: float  # problems measured (its share of the prior)
    answer_length: int | None
    curve: Curve
    signature: tuple[float, ...] = ()  # first-step confidence shares per bin (uniform over [0, 1])

    def __post_init__(self) -> None:
        if self.weight <= 0 or not self.curve:
            raise ValueError(f"risk profile {self.name}: needs a positive weight and a curve")
        if any(not 0 <= a <= 1 for _, a in self.curve):
            raise ValueError(f"risk profile {self.name}: accuracies must be in [0, 1]")


@dataclass(frozen=True, slots=True)
class AccuracyModel:
    pooled: Curve
    profiles: tuple[RiskProfile, ...] = ()
    samples: tuple[tuple[float, float], ...] = ()  # (τ, problems measured) behind the pooled curve

    def __post_init__(self) -> None:
        if not self.pooled:
            raise ValueError("accuracy model needs at least one (τ, accuracy) point")

    @classmethod
    def from_eval(cls, path_or_rows: str | Path | Iterable[Mapping], tasks: Sequence[str] | None = None
                  ) -> "AccuracyModel":
        """From `python -m dilaserve_jax.tasks.eval --json` rows (refused without accuracy)."""
        from dilaserve_jax.serving.policy.eval_rows import accuracy_from_eval_json, read_eval_rows

        rows = read_eval_rows(path_or_rows, tasks)
        pooled = tuple(sorted(accuracy_from_eval_json(rows).items()))
        samples: dict[float, float] = {}
        for r in rows:
            samples[float(r["threshold"])] = samples.get(float(r["threshold"]), 0.0) + float(r["n"])
        profiles = []
        if not all(r.get("kind") == "summary" for r in rows):
            for name in dict.fromkeys(r["task"] for r in rows):
                mine = [r for r in rows if r["task"] == name]
                sig = next((tuple(float(x) for x in r["first_step_confidence"]) for r in mine
                            if r.get("first_step_confidence")), ())
                length = next((int(r["answer_length"]) for r in mine if r.get("answer_length")), None)
                profiles.append(RiskProfile(name, max(float(r["n"]) for r in mine), length,
                                            tuple(sorted((float(r["threshold"]), float(r["accuracy"])) for r in mine)),
                                            sig))
        return cls(pooled, tuple(profiles), tuple(sorted(samples.items())))

    def accuracy(self, tau: float) -> float:
        return interpolate(tau, self.pooled)

    def plateau(self, z: float = PLATEAU_Z) -> Plateau:
        """Where accuracy stops growing measurably with τ (see `plateau_tau`)."""
        return plateau_tau(self.pooled, dict(self.samples), z)

    def loss(self, tau: float, ref: float) -> float:
        """Pooled expected loss in points at τ relative to τ_ref."""
        return curve_loss(self.pooled, tau, ref)

    def floor(self, budget: float | None, ref: float, candidates: Sequence[float]) -> float:
        """The lowest candidate τ whose pooled loss is within `budget` points (None: the lowest)."""
        ok = [t for t in candidates if budget is None or self.loss(t, ref) <= budget + 1e-9]
        return min(ok) if ok else max(candidates)

    def prior(self, answer_length: int | None, use_length: bool = True) -> tuple[float, ...]:
        """Profile weights before any step: the profiles with this answer area, else all."""
        if not self.profiles:
            return ()
        match = [p.answer_length == answer_length for p in self.profiles]
        if not use_length or not any(match):
            match = [True] * len(self.profiles)
        w = [p.weight if m else 0.0 for p, m in zip(self.profiles, match)]
        total = sum(w)
        return tuple(x / total for x in w)

    def posterior(self, answer_length: int | None, counts: Sequence[int], temperature: float = 4.0,
                  use_length: bool = True) -> tuple[float, ...]:
        """Profile weights given the request's first-step confidence histogram (counts per bin)."""
        prior = self.prior(answer_length, use_length)
        if not prior or not counts or sum(counts) == 0:
            return prior
        logs = []
        for p, w in zip(self.profiles, prior):
            sig, cnt = _same_bins(p.signature, counts)
            if w == 0 or not sig:
                logs.append(-math.inf if w == 0 else math.log(w))
                continue
            smooth = [(s + 1e-3) / (1 + 1e-3 * len(sig)) for s in sig]
            logs.append(math.log(w) + sum(c * math.log(s) for c, s in zip(cnt, smooth)) / temperature)
        top = max(logs)
        ex = [math.exp(x - top) if x > -math.inf else 0.0 for x in logs]
        total = sum(ex)
        return tuple(x / total for x in ex)

    def profile_losses(self, tau: float, ref: float) -> tuple[float, ...]:
        return tuple(curve_loss(p.curve, tau, ref) for p in self.profiles)


def changed_commits(counts: Sequence[int], max_confidence: float | None, tau: float, ref: float) -> int:
    """Masked positions a step at τ commits that a step at τ_ref > τ would not: confidence in (τ, τ_ref],
    less the most confident one (committed at any τ). Counted from the histogram's bins that overlap
    [τ, τ_ref] (exact when both lie on bin edges, else an overcount)."""
    k = len(counts)
    lo, hi = math.floor(tau * k + 1e-9), min(k - 1, math.ceil(ref * k - 1e-9) - 1)
    band = sum(counts[max(0, lo):hi + 1]) if hi >= lo else 0
    if band and max_confidence is not None and tau < max_confidence <= ref:
        band -= 1  # the argmax sits in the band: it is committed at τ_ref too
    return band


def _same_bins(signature: Sequence[float], counts: Sequence[int]) -> tuple[list[float], list[int]]:
    """Bring a signature and a histogram to the same (coarser) uniform bins; ([], []) if impossible."""
    ns, nc = len(signature), len(counts)
    if not ns or not nc:
        return [], []
    if ns == nc:
        return list(signature), list(counts)
    if nc % ns == 0:
        k = nc // ns
        return list(signature), [sum(counts[i * k:(i + 1) * k]) for i in range(ns)]
    if ns % nc == 0:
        k = ns // nc
        return [sum(signature[i * k:(i + 1) * k]) for i in range(nc)], list(counts)
    return [], []
