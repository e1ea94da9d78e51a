"""What a lower τ costs in answer quality, and the budget that bounds it (pure Python; no JAX).

Accuracy model (`AccuracyModel`, from the eval rows that also give the speed prior):
  - the pooled curve τ → accuracy (correct / problems over every task's rows);
  - one risk profile per task: its own τ → accuracy curve, its answer area, and its first-step
    confidence signature (how its masked positions' confidences are spread at a request's first
    step, before anything is committed).
  Loss at τ relative to a reference τ_ref is in accuracy points and made monotone:
  loss(τ) = max(0, acc(τ_ref) − min acc over [τ, τ_ref]), so a measured bump below τ_ref is never
  counted as a gain. τ_ref is one fixed reference for every request (`QualityConfig.reference_tau`,
  serve's τ ceiling by default), or the request's own τ_max if that is lower (a τ the caller chose
  is not the server's spend). A request that asks for a τ_max above the reference may run up to it
  when it has slack; those steps cost latency only, and count as no loss and no gain.

Plateau (`plateau_tau`): the lowest τ whose accuracy is within the measured noise of the best τ's
(and every τ above it as well): accuracy gaps inside a z-interval of the two binomial estimates are
not told apart from zero. A ceiling above it buys no measurable accuracy for many more steps, so
it is serve's default τ ceiling.

A request's expected loss mixes the profiles' losses by a posterior: the prior is every profile
with the request's answer area (weighted by problems measured; all profiles if none matches);
the request's own first-step confidence histogram updates it (multinomial likelihood against each
signature, tempered because the positions of one request are not independent). A small share
(`prior_weight`) always stays on the pooled prior: evidence is never conclusive, so a τ whose
pooled loss is positive never costs a request exactly nothing.

Loss over a request's life: a step at τ below τ_max changes the answer only if it commits a
position τ_max would not have: a masked position with confidence in (τ, τ_max], other than the
most confident one (committed at any τ). The step's confidence histogram says how many there were;
a step that changed nothing leaves the request exactly on its τ_max trajectory and costs nothing.
A step that did change commits charges the request the loss of running it wholly at that τ (the
eval rows measure nothing finer, and the positions a lower τ adds are exactly the uncertain ones,
so spreading the loss over the tokens would undercount it): a request's predicted loss is the
largest loss(τ) over its steps that changed commits.

Budget (`QualityBudget`): the mean predicted loss over the requests an instance serves stays
within `max_accuracy_drop` points. Every request in the pool brings that many points of
allowance; what it does not spend, others may. The controller grants lower τ where it buys a
deadline, cheapest first, and never more than the allowance left. A predicted loss is a chance of
a wrong answer, so the drop actually measured scatters around the mean: the pool also keeps that
scatter inside the bound, mean + z·σ ≤ budget, where σ is the standard deviation of the measured
drop if each request fails independently with its predicted probability (z = 1.64: the measured
drop stays within the budget with about 95% probability when the predictions are calibrated). A
few coin-flip gambles (a 45-point loss on an unidentified request) cost far more margin than many
small, well-identified ones. A request with its own `max_accuracy_drop` is held to it individually
(in expectation) and stays out of the pool. Mode `floor` is the baseline: no evidence, no
pooling, every request at or above the lowest τ whose pooled loss is within budget.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

BUDGET_MODES = ("adaptive", "floor")
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


@dataclass(frozen=True, slots=True)
class QualityConfig:
    model: AccuracyModel
    max_accuracy_drop: float | None = 1.0  # points vs the accuracy at the reference τ; None: unbounded
    # the τ losses are measured from, for every request (capped by a lower τ_max of its own);
    # None: each request's own τ_max
    reference_tau: float | None = None
    mode: str = "adaptive"
    prior_weight: float = 0.02  # share of the pooled prior kept in every request's posterior
    evidence_temperature: float = 4.0  # the first-step log-likelihood is divided by this
    use_length: bool = True  # condition the prior on the request's answer area
    use_confidence: bool = True  # update it with the request's first-step confidences
    confidence_z: float = 1.64  # the pool keeps mean + z·σ of the measured drop within the budget (0: the mean)

    def __post_init__(self) -> None:
        if self.mode not in BUDGET_MODES:
            raise ValueError(f"budget mode must be one of {BUDGET_MODES}, got {self.mode!r}")
        if self.max_accuracy_drop is not None and not (self.max_accuracy_drop >= 0 and math.isfinite(self.max_accuracy_drop)):
            raise ValueError(f"max_accuracy_drop must be a finite number of points >= 0 (or None), got {self.max_accuracy_drop}")
        if not 0 < self.prior_weight <= 1 or self.evidence_temperature <= 0 or self.confidence_z < 0:
            raise ValueError("prior_weight must be in (0, 1], evidence_temperature > 0 and confidence_z >= 0")
        if self.reference_tau is not None and not 0 < self.reference_tau <= 1:
            raise ValueError(f"reference τ must be in (0, 1], got {self.reference_tau}")

    @classmethod
    def from_eval(cls, path_or_rows, **kw) -> "QualityConfig":
        return cls(AccuracyModel.from_eval(path_or_rows), **kw)


@dataclass(frozen=True, slots=True)
class QualitySnapshot:
    """Accounting an instance publishes (cluster state, metrics)."""

    budget: float | None  # points; None: unbounded
    mode: str
    served: int  # requests finished (ok) whose loss was predicted
    predicted_loss_mean: float  # points, mean over those
    predicted_loss_spent: float  # points, total over those and the active ones
    allowance: float | None  # points the pool may still spend now (None: unbounded)
    mean_tau: float | None  # over every step run

    def as_dict(self) -> dict:
        return {"budget": self.budget, "mode": self.mode, "served": self.served,
                "predicted_loss_mean": self.predicted_loss_mean, "predicted_loss_spent": self.predicted_loss_spent,
                "allowance": self.allowance, "mean_tau": self.mean_tau}


@dataclass(slots=True)
class QualityBudget:
    """Per-instance predicted-loss accounting and the grant rule; requests are duck-typed (id,
    answer_length, committed, tau_max, evidence, predicted_loss, max_accuracy_drop)."""

    cfg: QualityConfig
    served: int = 0
    served_pooled: int = 0
    spent_served: float = 0.0  # pooled requests finished ok
    scatter_served: float = 0.0  # Σ L·(100 − L) over them: the variance of their measured drop (points², × N²)
    loss_served: float = 0.0  # every request finished ok (pooled or individually budgeted)
    pooled_active: dict[str, float] = field(default_factory=dict)  # id -> predicted loss so far
    tau_sum: float = 0.0
    tau_steps: int = 0
    _weights: dict[str, tuple[float, ...]] = field(default_factory=dict)
    _losses: dict[tuple[float, float], tuple[float, ...]] = field(default_factory=dict)

    # --- the model, per request ---
    def reference(self, req) -> float:
        """The τ this request's losses are measured from: the fixed reference, or its own lower τ_max."""
        ref = self.cfg.reference_tau
        return req.tau_max if ref is None else min(req.tau_max, ref)

    def budget_of(self, req) -> float | None:
        own = getattr(req, "max_accuracy_drop", None)
        return own if own is not None else self.cfg.max_accuracy_drop

    def pooled(self, req) -> bool:
        return getattr(req, "max_accuracy_drop", None) is None

    def weights(self, req) -> tuple[float, ...]:
        w = self._weights.get(req.id)
        if w is None:
            m, c = self.cfg.model, self.cfg
            counts = req.evidence if c.use_confidence else ()
            post = m.posterior(req.answer_length, counts, c.evidence_temperature, c.use_length)
            base = m.prior(None, use_length=False)
            w = tuple((1 - c.prior_weight) * p + c.prior_weight * b for p, b in zip(post, base))
            self._weights[req.id] = w
        return w

    def loss(self, req, tau: float) -> float:
        """Expected loss in points of running the whole request at τ (vs its reference τ)."""
        ref = self.reference(req)
        if tau >= ref:
            return 0.0
        m = self.cfg.model
        if self.cfg.mode == "floor" or not m.profiles:
            return m.loss(tau, ref)
        key = (tau, ref)
        table = self._losses.get(key)
        if table is None:
            table = self._losses[key] = m.profile_losses(tau, ref)
        return sum(w * x for w, x in zip(self.weights(req), table))

    def cost(self, req, tau: float) -> float:
        """Predicted loss (points) added if the request's next steps run at τ and change commits."""
        return max(0.0, self.loss(req, tau) - req.predicted_loss)

    def floor(self, req, candidates: Sequence[float]) -> float:
        """The fixed floor: lowest candidate whose pooled loss is within the request's budget."""
        return self.cfg.model.floor(self.budget_of(req), self.reference(req), candidates)

    # --- accounting ---
    def allowance(self) -> float | None:
        """Points the pool could still add now (before the added spend's own scatter)."""
        b = self.cfg.max_accuracy_drop
        if b is None:
            return None
        spent, scatter, n = self._pool()
        return b * n - spent - self.cfg.confidence_z * math.sqrt(scatter)

    def _pool(self) -> tuple[float, float, int]:
        """(Σ L, Σ L·(100 − L), requests) over the pool: served and active."""
        active = self.pooled_active.values()
        return (self.spent_served + sum(active), self.scatter_served + sum(x * (100.0 - x) for x in active),
                self.served_pooled + len(self.pooled_active))

    def _within(self, spent: float, scatter: float, n: int) -> bool:
        return spent + self.cfg.confidence_z * math.sqrt(max(0.0, scatter)) <= self.cfg.max_accuracy_drop * n + 1e-9

    def join(self, req) -> None:
        if self.pooled(req) and req.id not in self.pooled_active:
            self.pooled_active[req.id] = req.predicted_loss

    def set_evidence(self, req, counts: Sequence[int]) -> None:
        if not req.evidence and counts and sum(counts) > 0:
            req.evidence = tuple(int(c) for c in counts)
            self._weights.pop(req.id, None)

    def charge(self, req, tau: float, counts: Sequence[int] = (), max_confidence: float | None = None) -> float:
        """Charge one step run at τ, given its confidence histogram (before commit) and highest
        confidence; returns the points added. Without a histogram the step is assumed to have changed
        commits."""
        added = 0.0
        ref = self.reference(req)
        if tau < ref and (not counts or changed_commits(counts, max_confidence, tau, ref) > 0):
            added = max(0.0, self.loss(req, tau) - req.predicted_loss)
            req.predicted_loss += added
        self.join(req)
        if req.id in self.pooled_active:
            self.pooled_active[req.id] = req.predicted_loss
        self.tau_sum += tau
        self.tau_steps += 1
        return added

    def forget(self, req_id: str, predicted_loss: float | None = None, served: bool = False) -> None:
        """A request left: if it was served (finished ok), its loss stays in the mean."""
        pooled = self.pooled_active.pop(req_id, None)
        self._weights.pop(req_id, None)
        if served and predicted_loss is not None:
            self.served += 1
            self.loss_served += predicted_loss
            if pooled is not None:
                self.served_pooled += 1
                self.spent_served += predicted_loss
                self.scatter_served += predicted_loss * (100.0 - predicted_loss)

    def snapshot(self) -> QualitySnapshot:
        allow = self.allowance()
        return QualitySnapshot(self.cfg.max_accuracy_drop, self.cfg.mode, self.served,
                               self.loss_served / self.served if self.served else 0.0,
                               self.loss_served + sum(self.pooled_active.values()), allow,
                               self.tau_sum / self.tau_steps if self.tau_steps else None)

    # --- the grant rule ---
    def grant(self, reqs: Sequence, desired: Mapping[str, float], at_risk: Mapping[str, bool],
              candidates: Mapping[str, Sequence[float]]) -> dict[str, float]:
        """Per request the lowest τ it may run at this round.

        Free: every candidate that costs nothing. A request whose deadline needs a τ that costs
        something (`desired`, not at risk) is granted it, cheapest first, while the pool's allowance
        (or its own budget) covers the predicted cost of finishing at that τ; otherwise it stays at
        its lowest free τ. Mode `floor`: the fixed floor for everyone.
        """
        floors: dict[str, float] = {}
        if self.cfg.mode == "floor":
            return {r.id: self.floor(r, candidates[r.id]) for r in reqs}
        asks = []
        for r in reqs:
            cands = candidates[r.id]
            free = min((t for t in cands if self.cost(r, t) <= 1e-12), default=max(cands))
            floors[r.id] = free
            want = desired.get(r.id, free)
            if want < free and not at_risk.get(r.id, False):
                asks.append((self.cost(r, want), r.deadline, r, want))
        bounded = self.cfg.max_accuracy_drop is not None
        spent, scatter, n = self._pool() if bounded else (0.0, 0.0, 0)
        for cost, _, r, want in sorted(asks, key=lambda a: (a[0], a[1])):
            if self.pooled(r):
                if not bounded:
                    floors[r.id] = want
                    continue
                old = r.predicted_loss
                new_scatter = scatter - old * (100.0 - old) + (old + cost) * (100.0 - old - cost)
                if self._within(spent + cost, new_scatter, n):
                    floors[r.id] = want
                    spent, scatter = spent + cost, new_scatter
            elif r.predicted_loss + cost <= self.budget_of(r) + 1e-12:
                floors[r.id] = want
        return floors
