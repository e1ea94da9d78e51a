"""The accuracy-loss budget: what each request's lower τ is predicted to cost, and the rule that
keeps the mean within the budget (pure Python; no JAX). The accuracy model is `accuracy.py`.

Reference: losses are measured from one fixed τ for every request (`QualityConfig.reference_tau`,
serve's τ ceiling by default), or the request's own τ_max if that is lower (a τ the caller chose
is not the server's spend). A request that asks for a τ_max above the reference may run up to it
when it has slack; those steps cost latency only, and count as no loss and no gain.

A request's expected loss mixes the accuracy model's per-task losses by its posterior. A small
share (`prior_weight`) always stays on the pooled prior: evidence is never conclusive, so a τ
whose pooled loss is positive never costs a request exactly nothing.

Loss over a request's life: a step at τ below the reference changes the answer only if it commits
a position the reference would not have: a masked position with confidence in (τ, τ_ref], other
than the most confident one (committed at any τ). The step's confidence histogram says how many
there were; a step that changed nothing leaves the request exactly on its reference trajectory and
costs nothing. A step that did change commits charges the request the loss of running it wholly at
that τ (the eval rows measure nothing finer, and the positions a lower τ adds are exactly the
uncertain ones, so spreading the loss over the tokens would undercount it): a request's predicted
loss is the largest loss(τ) over its steps that changed commits.
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
from typing import Mapping, Sequence

from dilaserve_jax.serving.policy.accuracy import AccuracyModel, changed_commits

BUDGET_MODES = ("adaptive", "floor")


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

    def free_floor(self, tau_min: float, tau_max: float, grid: Sequence[float]) -> float:
        """The lowest τ of `grid` in [tau_min, tau_max] whose pooled loss from the reference is within
        the budget: where thresholds can go under load without the budget holding them (what the
        cluster controller should price layouts at)."""
        cands = sorted({t for t in grid if tau_min - 1e-12 <= t <= tau_max + 1e-12} | {tau_min, tau_max})
        ref = tau_max if self.reference_tau is None else min(self.reference_tau, tau_max)
        return max(tau_min, self.model.floor(self.max_accuracy_drop, ref, cands))


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
    pressure: bool = False  # deadlines are being lost to load: spare allowance buys speed (threshold.py)

    def as_dict(self) -> dict:
        return {"budget": self.budget, "mode": self.mode, "served": self.served,
                "predicted_loss_mean": self.predicted_loss_mean, "predicted_loss_spent": self.predicted_loss_spent,
                "allowance": self.allowance, "mean_tau": self.mean_tau, "pressure": self.pressure}


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
    _own_losses: dict[str, dict[tuple[float, float], float]] = field(default_factory=dict)  # id -> (τ, ref) -> loss
    _free: dict[str, tuple[tuple, float]] = field(default_factory=dict)  # id -> (what it depends on, free τ)

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
        mine = self._own_losses.setdefault(req.id, {})  # dropped with its weights
        out = mine.get(key)
        if out is None:
            table = self._losses.get(key)
            if table is None:
                table = self._losses[key] = m.profile_losses(tau, ref)
            out = mine[key] = sum(w * x for w, x in zip(self.weights(req), table))
        return out

    def free_tau(self, req, candidates: Sequence[float]) -> float:
        """The lowest candidate that costs nothing (the highest when every one costs); kept until
        the request's predicted loss, τ_max, candidates or weights change."""
        key = (req.predicted_loss, req.tau_max, candidates)
        hit = self._free.get(req.id)
        if hit is not None and hit[0] == key:
            return hit[1]
        free = min((t for t in candidates if self.cost(req, t) <= 1e-12), default=max(candidates))
        self._free[req.id] = (key, free)
        return free

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
            self._own_losses.pop(req.id, None)
            self._free.pop(req.id, None)

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
        self._own_losses.pop(req_id, None)
        self._free.pop(req_id, None)
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
              candidates: Mapping[str, Sequence[float]],
              throughput: Mapping[str, float] | None = None) -> dict[str, float]:
        """Per request the lowest τ it may run at this round.

        Free: every candidate that costs nothing. A request whose deadline needs a τ that costs
        something (`desired`) is granted it, cheapest first, while the pool's allowance (or its own
        budget) covers the predicted cost of finishing at that τ; otherwise it stays at its lowest
        free τ. Requests at risk ask after every request still in time: a late request run fast
        frees its slot sooner for the others, so what the budget has left is spent on that (held at
        its free τ, a request past saving keeps its slot longest). `throughput`: a lower τ each
        request is asked to run at for the arrivals behind it (arrival pressure), granted with what
        is left after every deadline's ask, cheapest first. Mode `floor`: the fixed floor for
        everyone.
        """
        floors: dict[str, float] = {}
        if self.cfg.mode == "floor":
            return {r.id: self.floor(r, candidates[r.id]) for r in reqs}
        asks = []
        for r in reqs:
            free = floors[r.id] = self.free_tau(r, candidates[r.id])
            want = desired.get(r.id, free)
            if want < free:
                asks.append((at_risk.get(r.id, False), self.cost(r, want), r.deadline, r, want))
        bounded = self.cfg.max_accuracy_drop is not None
        spent, scatter, n = self._pool() if bounded else (0.0, 0.0, 0)
        added: dict[str, float] = {}  # predicted loss each pooled grant adds this round

        def ask(r, want: float, cost: float) -> None:
            """Grant `want` if the pool (or the request's own budget) covers `cost` more."""
            nonlocal spent, scatter
            if not self.pooled(r):
                if r.predicted_loss + self.cost(r, want) <= self.budget_of(r) + 1e-12:
                    floors[r.id] = want
                return
            if not bounded:
                floors[r.id] = want
                return
            old = r.predicted_loss + added.get(r.id, 0.0)
            new_scatter = scatter - old * (100.0 - old) + (old + cost) * (100.0 - old - cost)
            if self._within(spent + cost, new_scatter, n):
                floors[r.id] = want
                spent, scatter = spent + cost, new_scatter
                added[r.id] = added.get(r.id, 0.0) + cost

        for _, cost, _, r, want in sorted(asks, key=lambda a: a[:3]):
            ask(r, want, cost)
        if throughput:  # after every deadline's ask, priced from the floor each was left at
            extra = [(self.cost(r, w) - self.cost(r, floors[r.id]), r.deadline, r, w) for r in reqs
                     if (w := throughput.get(r.id)) is not None and w < floors[r.id] - 1e-12]
            for cost, _, r, want in sorted(extra, key=lambda a: a[:2]):
                ask(r, want, cost)
        return floors
