"""Per-request confidence-threshold control and load control (pure Python; no JAX).

Each step, for every running and queued request:
  steps(τ) = Σ over remaining blocks of ceil(masked tokens in block / tokens-per-step(τ)), one of
             which per block is a refresh (the current block's only if its refresh is still due);
  time(τ)  = n_refresh · T_refresh(B) + n_reuse · T_reuse(B), latency model at the current batch B
             (all active requests advance one step per round, so B is the round's batch);
  τ        = the highest τ in [τ_min, τ_max] (and ≤ the load cap) with start + time(τ) ≤ deadline.
Tokens-per-step(τ) is an online estimate: a prior (τ → tokens/step, measured by the eval command),
updated by an exponential moving average per τ bucket, times a per-request speed ratio (hard prompts
commit fewer tokens per step than the average).

Load control: requests are placed on the slots in deadline order (queued ones start when a slot
frees). If some cannot meet their deadlines, a system-wide cap on τ is lowered (never below each
request's τ_min) to the highest cap that makes as many as possible feasible — thresholds drop
*before* requests miss. When more than `plan_depth` x slots requests queue, those past saving
(they would miss even started now, alone, at τ_min; found once each) and the least urgent beyond
that depth are not planned that round: they wait at risk, and a round's cost stays bounded however
deep the queue. Whether a queued request is past saving is checked again only from a margin
(`LOST_CHECK_MARGIN`: from three times its time earlier) before the slack its last check found
runs out (approximation: a request whose predicted time grows by more than that meanwhile is
found lost later; until then it is one more candidate the plan itself marks at risk).
Prices (`step_pricing.py`) are memoised until an estimate changes (a step's observation, the latency correction), so
the plan, admission, batching and the published load price each (request, τ, batch) once, and the
plan prices a τ only when a pass reaches it. A request infeasible even at τ_min is marked at
risk: it does not hold a place in the slot model and the scheduler runs it only on spare capacity.

Quality budget (`ThresholdConfig.quality`, see `quality.py`): the plan above gives each request the
τ its deadline (and the queue) needs; where that τ is predicted to cost accuracy, the budget grants
it (cheapest first, within the allowance) or holds the request at its lowest free τ, and the plan is
made again with those floors. Every step's commits are charged to the request's predicted loss.

Arrival pressure: the deadlines in hand never ask for speed on behalf of the arrivals behind them.
When at least `pressure_at_risk_share` of the requests planned over the last `pressure_window_s`
were at risk, deadlines are being lost to load, and every request also asks for the budget's fixed
floor; the budget grants those asks after every deadline's (`QualityBudget.grant(throughput=...)`),
so only the allowance left over buys speed, and the request runs at the lower τ where granted.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from dilaserve_jax.serving.policy.plan_pass import (BY_DEADLINE, Candidate, Decision, boundary,
                                                    first_at_or_below, misses, schedule_pass)
from dilaserve_jax.serving.policy.pressure import PressureWindow
from dilaserve_jax.serving.policy.quality import QualityBudget, QualitySnapshot
from dilaserve_jax.serving.policy.threshold_config import ThresholdConfig  # noqa: F401 (re-exported)
from dilaserve_jax.serving.policy.request import Request
from dilaserve_jax.serving.policy.step_pricing import StepPricing
from dilaserve_jax.serving.policy.step_time import StepTime

# a queued request's lost check is due again this share of its time before its slack runs out
LOST_CHECK_MARGIN = 3.0


@dataclass(slots=True)
class ThresholdController(StepPricing):
    cap: float = 1.0  # current load-control cap (for reporting)
    preempting: bool = False  # the scheduler preempts running requests at risk for queued ones in time
    runs_ahead: bool = False  # the scheduler admits a request that fits by running ahead of the others
    budget: QualityBudget | None = None  # from cfg.quality
    _last_tau: dict[str, float] = field(default_factory=dict)
    _floors: dict[str, float] = field(default_factory=dict)  # lowest τ the budget allows, this round
    _lost: set[str] = field(default_factory=set)  # queued requests past saving (deep queues only)
    _lowest: dict[str, float] = field(default_factory=dict)  # lowest τ each may run at (budget's grant)
    _lost_due: dict[str, float] = field(default_factory=dict)  # queued: when to check again if it is lost
    _unplanned_memo: dict[str, Decision] = field(default_factory=dict)  # queued, unplanned: its decision
    pressure: bool = False  # deadlines are being lost to load: the budget's spare allowance buys speed
    _pressure: PressureWindow | None = None  # from cfg (pressure.py)
    _cands_memo: dict[tuple[float, float], tuple[float, ...]] = field(default_factory=dict)  # (τ_min, τ_max) ->

    def __post_init__(self) -> None:
        StepPricing.__post_init__(self)  # (a slotted dataclass: no zero-argument super())
        if self.budget is None and self.cfg.quality is not None:
            self.budget = QualityBudget(self.cfg.quality)
        if self._pressure is None:
            self._pressure = PressureWindow(self.cfg.pressure_window_s, self.cfg.pressure_at_risk_share)

    # --- online estimates ---
    def observe(self, req: Request, tau: float, n_committed: int, block_finished: bool, *,
                confidence_counts: Sequence[int] = (), max_confidence: float | None = None) -> None:
        """One step's result (after `req.record_step`): rates; the quality charge (from the step's
        confidence histogram and highest confidence) and the request's first-step evidence."""
        if self.budget is not None:
            self.budget.charge(req, tau, confidence_counts, max_confidence)  # at the weights τ was chosen with
            self.budget.set_evidence(req, confidence_counts)
        if block_finished:  # commits capped by the block end say nothing about the rate
            return
        expected = self.tps.rate(tau)
        r = self.ratios.get(req.id, 1.0)
        r += self.cfg.request_ema * (n_committed / expected - r)
        self.ratios[req.id] = min(4.0, max(0.25, r))
        self.tps.observe(tau, n_committed)
        self._time_memo.clear()  # the step times (`_cost_memo`) do not depend on the rates

    def forget(self, req_id: str, served_loss: float | None = None) -> None:
        """The request left; `served_loss`: it finished ok with this predicted loss (counts in the mean)."""
        self.ratios.pop(req_id, None)
        self._lost.discard(req_id)
        self._lost_due.pop(req_id, None)
        self._unplanned_memo.pop(req_id, None)
        self._steps_memo.pop(req_id, None)
        self._time_memo.clear()  # an id may come back (moved away and back): no price of its old state survives
        self._lowest.pop(req_id, None)
        self._last_tau.pop(req_id, None)
        self._floors.pop(req_id, None)
        self._pressure.forget(req_id)
        if self.budget is not None:
            self.budget.forget(req_id, served_loss, served=served_loss is not None)

    def quality_snapshot(self) -> QualitySnapshot | None:
        return None if self.budget is None else dataclasses.replace(self.budget.snapshot(), pressure=self.pressure)

    def candidates(self, req: Request) -> tuple[float, ...]:
        key = (req.tau_min, req.tau_max)
        out = self._cands_memo.get(key)
        if out is None:
            taus = {t for t in self.cfg.grid if req.tau_min <= t <= req.tau_max} | {req.tau_min, req.tau_max}
            out = self._cands_memo[key] = tuple(sorted(taus, reverse=True))
        return out

    def _allowed(self, req: Request) -> Sequence[float]:
        """Candidates at or above this round's budget floor (τ_min stays the hard floor)."""
        floor = self._floors.get(req.id)
        cands = self.candidates(req)
        return cands if floor is None else tuple(t for t in cands if t >= floor - 1e-12) or cands[:1]

    def lowest_tau(self, req: Request) -> float:
        """The lowest τ it may run at: what the budget's last grant allows it (its free τ, or the
        faster one it was granted), τ_min before any grant or without a budget. Feasibility is
        judged here: a request the budget holds at 0.9 does not finish at τ_min's speed."""
        return self._lowest.get(req.id, req.tau_min)

    def feasible_at(self, req: Request, start: float, batch: int, step_time: StepTime) -> bool:
        """Can it meet its deadline at its lowest allowed τ, starting at `start` with this batch?"""
        return start + self.remaining_time(req, self.lowest_tau(req), batch, step_time) <= req.deadline

    # --- the per-step plan ---
    def plan(self, running: Sequence[Request], waiting: Sequence[Request], now: float, num_slots: int,
             step_time: StepTime) -> dict[str, Decision]:
        """τ and at-risk flag for every running and queued request (also sets `req.at_risk`)."""
        if not running and not waiting:
            return {}
        depth = self.cfg.plan_depth * num_slots
        beyond: list[Request] = []
        if len(waiting) > depth:  # deep queue: the lost ones and the least urgent of the rest wait unplanned
            self._find_lost(waiting, now, step_time)
            beyond = [w for w in waiting if w.id in self._lost]
            order = sorted([w for w in waiting if w.id not in self._lost], key=BY_DEADLINE)
            waiting, beyond = order[:depth], beyond + order[depth:]
        active = [(r, True) for r in running] + [(w, False) for w in waiting]
        if not active:  # every queued request is lost
            return self._unplanned(beyond, now, {})
        free = max(0, num_slots - len(running))
        # the others' refresh share at their previous τ (or τ_max) sets how often refreshes interleave
        fracs = {r.id: self.refresh_fraction(r, self._last_tau.get(r.id, r.tau_max)) for r, _ in active}
        self.mean_refresh_fraction = sum(fracs.values()) / len(fracs)
        # at risk: joining the others (deadline order) would make someone infeasible even at the
        # lowest τ the budget last granted it (τ_min before any grant), starting now; they run on
        # spare capacity only, so the rest are planned without them
        # (or, with `runs_ahead`, where joining fails: it runs alone first and delays the others by
        # its own time — least slack first does exactly that — and still everyone makes it)
        risky: set[str] = set()
        members: list[Request] = []
        feasible = self._feasibility(now, step_time)
        lead = 0.0  # seconds of requests run ahead of the members

        def ahead_of(members: list[Request], req: Request, lead: float) -> float | None:
            """Its time alone, if it can run ahead of the members and they all still make it."""
            if not feasible(req, 1, lead):
                return None
            alone = self.remaining_time(req, self.lowest_tau(req), 1, step_time)
            return alone if all(feasible(r, len(members), lead + alone) for r in members) else None
        for req, _ in sorted(active, key=lambda a: (not a[1], a[0].deadline, a[0].arrival)):
            n = len(members)  # it joins all of them while there are slots, else it stands alone
            if feasible(req, n + 1 if n < num_slots else num_slots, lead) and (
                    n >= num_slots or all(feasible(r, n + 1, lead) for r in members)):
                members.append(req)
            elif self.runs_ahead and 0 < n < num_slots and (alone := ahead_of(members, req, lead)) is not None:
                members.append(req)
                lead += alone
            else:
                risky.add(req.id)
        self._floors = {}
        cap, best = self._solve(active, fracs, risky, now, num_slots, free, step_time)
        self.pressure = self.budget is not None and self._pressure.observe(
            (r.id for r, _ in active), (rid for rid, d in best.items() if rid in risky or d.at_risk), now)
        if self.budget is not None:
            reqs = [r for r, _ in active]
            for r in reqs:
                self.budget.join(r)
            wants = ({r.id: self.budget.floor(r, self.candidates(r)) for r in reqs} if self.pressure else None)
            floors = self.budget.grant(reqs, {rid: d.tau for rid, d in best.items()},
                                       {rid: d.at_risk or rid in risky for rid, d in best.items()},
                                       {r.id: self.candidates(r) for r in reqs}, throughput=wants)
            self._lowest.update(floors)
            if any(best[rid].tau < f - 1e-12 for rid, f in floors.items()):
                self._floors = floors
                cap, best = self._solve(active, fracs, risky, now, num_slots, free, step_time)
            if wants:  # run at the budget's floor where it granted it (the deadlines alone need no more)
                best = {rid: d if (t := max(floors[rid], wants[rid])) >= d.tau else
                        Decision(t, d.at_risk, d.predicted_finish, d.predicted_start) for rid, d in best.items()}
        best = {rid: (Decision(d.tau, True, d.predicted_finish, d.predicted_start) if rid in risky else d)
                for rid, d in best.items()}
        self.cap = cap
        self._last_tau = {rid: d.tau for rid, d in best.items()}
        for req, _ in active:
            req.at_risk = best[req.id].at_risk
        return self._unplanned(beyond, now, best)

    def _feasibility(self, now: float, step_time: StepTime) -> Callable[..., bool]:
        """`feasible_at(req, now + lead, batch, step_time)` for one round's plan, each request's steps
        at its lowest τ worked out once (the same terms and arithmetic as `remaining_time`'s)."""
        self._pricing_with(step_time)
        safety, share, need = self.cfg.safety, self.mean_refresh_fraction, {}

        def feasible(req: Request, batch: int, lead: float = 0.0) -> bool:
            n = need.get(req.id)
            if n is None:
                n = need[req.id] = self.steps_needed(req, self.lowest_tau(req))
            per_refresh, per_reuse = self._step_costs(req, batch, step_time, (batch - 1) * share)
            return now + lead + (n[0] * per_refresh + n[1] * per_reuse) * safety <= req.deadline
        return feasible

    def _find_lost(self, waiting: Sequence[Request], now: float, step_time: StepTime) -> None:
        """Mark the queued requests that miss even started now, alone, at τ_min (they stay so while
        they wait). A request is priced again only from `LOST_CHECK_MARGIN` of its time before the
        slack its last check found runs out, then every round: found when a check every round
        would find it unless its predicted time grew by more than the margin meanwhile."""
        lost, due, never = self._lost, self._lost_due, -math.inf
        for w in [w for w in waiting if w.id not in lost and now > due.get(w.id, never)]:
            alone = self.remaining_time(w, w.tau_min, 1, step_time)
            if now + alone > w.deadline:
                lost.add(w.id)
                due.pop(w.id, None)
            else:  # checked every round from a margin before the time this check gives it
                due[w.id] = w.deadline - alone * (1 + LOST_CHECK_MARGIN)

    def _unplanned(self, beyond: Sequence[Request], now: float, best: dict[str, Decision]) -> dict[str, Decision]:
        """Not planned this round: lowest priority, and fast if it runs anyway. Its decision is made
        once while it waits (a queued request's state does not change; its slack counts from now)."""
        memo = self._unplanned_memo
        for w in [w for w in beyond if w.id not in memo]:
            memo[w.id] = Decision(self.fast_tau(w), True, now, now)
        best.update([(w.id, memo[w.id]) for w in beyond])
        for w in beyond:
            w.at_risk = True
        return best

    def fast_tau(self, req: Request) -> float:
        """The τ an unplanned request runs at if it runs: the lowest that costs no accuracy budget
        (τ_min without a budget; the budget grants planned ones more, see `QualityBudget.grant`)."""
        cands = self.candidates(req)
        if self.budget is None:
            return cands[-1]
        return min((t for t in cands if self.budget.cost(req, t) <= 1e-12), default=cands[0])

    def _plan_candidates(self, active, fracs, excluded: set[str], num_slots: int, step_time: StepTime,
                         allowed: Callable[[Request], Sequence[float]]) -> list[Candidate]:
        """Each request's allowed τ (priced when a pass reaches them), in planning order (running
        first, then by deadline)."""
        n = len(active) - len(excluded)
        batch = max(1, min(n, num_slots))
        per_slot = (batch - 1) / max(1, n - 1) if n > 1 else 0.0
        total = sum(f for rid, f in fracs.items() if rid not in excluded)
        cands, firsts = [], {}
        caps = self._caps()
        for req, is_running in active:
            own = 0.0 if req.id in excluded else fracs[req.id]
            others = (total - own) * per_slot  # only `batch` of them run concurrently
            taus = allowed(req)
            per_refresh, per_reuse = self._step_costs(req, batch, step_time, others)
            blocks = req.blocks_left
            n_refresh = 0 if blocks == 0 else blocks if req.needs_refresh else blocks - 1
            first = firsts.get(id(taus))
            if first is None:  # (the τ lists come from a memo: a handful of distinct ones per round)
                first = firsts[id(taus)] = {cap: first_at_or_below(taus, cap) for cap in caps}
            cands.append(Candidate(req, taus, [None] * len(taus), is_running, per_refresh, per_reuse,
                               self.ratios.get(req.id, 1.0), blocks, req.masked_in_block, n_refresh, first))
        cands.sort(key=lambda c: (not c.running, c.req.id in excluded, c.req.deadline, c.req.arrival))
        return cands

    def _dur(self, c: Candidate, i: int) -> float:
        """`remaining_time` of the candidate at its i-th τ: the same terms and arithmetic, its steps
        counted as `steps_left` counts them (cheaper than the memo lookup `steps_needed` makes)."""
        d = c.durs[i]
        if d is None:
            n_ref = c.n_refresh
            if c.blocks == 0:
                n_reu = 0
            else:
                x = self.tps.rate(c.taus[i]) * c.ratio
                if not x > 1.0:
                    x = 1.0
                first, per_block = math.ceil(c.masked / x), math.ceil(c.req.block_length / x)
                n_reu = (first if first > 1 else 1) + (c.blocks - 1) * (per_block if per_block > 1 else 1) - n_ref
            d = c.durs[i] = (n_ref * c.per_refresh + n_reu * c.per_reuse) * self.cfg.safety
        return d

    def _pass(self, cands: list[Candidate], now: float, free: int, cap: float,
              may_miss: set[str] | None = None) -> dict[str, Decision] | None:
        return schedule_pass(cands, now, free, cap, may_miss, self._dur, self.preempting)

    def _caps(self) -> list[float]:
        """The load caps a plan tries, highest first: the τ grid and 1.0."""
        return sorted({t for t in self.cfg.grid} | {1.0}, reverse=True)

    def _solve(self, active, fracs, excluded: set[str], now: float, num_slots: int, free: int,
               step_time: StepTime) -> tuple[float, dict[str, Decision]]:
        cands = self._plan_candidates(active, fracs, excluded, num_slots, step_time, self._allowed)
        caps = self._caps()
        # the highest cap that (a) misses no request the floor cap would meet — a higher cap that
        # merely misses as *many*, but earlier-deadline ones, is not acceptable — and (b) lets every
        # queued request run at the cap too, so running requests do not spend the queue's slack
        # (thresholds drop together). Both get harder, nearly monotonically, with the cap, so the
        # answer is searched for as the boundary of a monotone test: from last round's cap outwards
        # (under steady load the answer moves little: two tests), doubling the step, then bisected
        floor = self._pass(cands, now, free, caps[-1])
        floor_misses = misses(floor)
        tested: dict[int, dict[str, Decision] | None] = {}

        def passes(i: int) -> bool:
            if i not in tested:
                tested[i] = self._pass(cands, now, free, caps[i], floor_misses)
            return tested[i] is not None

        i = boundary(passes, caps.index(self.cap) if self.cap in caps else 0, len(caps))
        return (caps[-1], floor) if i is None else (caps[i], tested[i])
