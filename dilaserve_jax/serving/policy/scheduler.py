"""Step-level scheduler for one instance (pure Python; the simulator reuses it unchanged).

Each round `schedule(now)` returns a `StepPlan`: slots to release, requests to admit into free
slots, and one batched step of a single kind (refresh or reuse) with a τ per slot. The scheduler
owns slot assignment but never calls a runner: the engine (or the simulator) applies the plan and
hands the outcomes back to `update`.

Policies (same interface):
  fcfs-static  arrival order, admit whenever a slot is free, batch every ready request of the kind
               the oldest request needs, fixed τ (0.9): how DLMs are served today.
  edf-static   the same in deadline order.
  dilaserve    least slack first; τ per request per step and load control from `threshold.py`
               (within the accuracy-loss budget when the threshold config carries one);
               a batch (and the set of running requests) grows only while every request in it
               still meets its deadline at the larger step time; at-risk requests run only on
               spare capacity.
Admission (all policies): a request predicted to miss its deadline even at τ_min on an idle
instance is served anyway by default (`best-effort`), late, after every request that can still
meet its own — dilaserve marks it at risk, which is the victim rule under overload: the requests
that are lost already give way, so the ones that can still make it do (EDF instead serves the
most urgent first, which under overload are exactly the lost ones, and every deadline behind them
falls too). `strict` refuses it at admission; a request may ask for either.
No starvation (all policies): a request that was runnable but skipped `max_skip` rounds in a row
goes first, whatever its deadline or risk. Where dilaserve splits batches (a step takes k of the n
running requests), a skipped round counts k/n: one turn in n/k rounds is a fair share, not neglect.
Under dilaserve a request at risk counts only `at_risk_skip_share` (1/8) of each skip: being passed
over for requests still in time is the victim rule, and counted in full, a backlog of lost requests
would all turn "starved" within `max_skip` rounds and go first again — FIFO, the domino EDF falls to.
It still goes first after max_skip / share rounds, and it runs before then whenever there is room.
The overload rules (on by default, `OVERLOAD_RULES`) bound what lost requests take under a lasting
overload: starved ones go first into one slot at a time, others join a step with requests in time
only when it costs at most 10% more, and they run shortest first (starved ones in arrival order).
"""
from __future__ import annotations

import bisect
import math

from dilaserve_jax.serving.policy.answer_fill import LastBlockFill
from dilaserve_jax.serving.policy.outcomes import RecentOutcomes
from dilaserve_jax.serving.policy.latency import LatencyModel
from dilaserve_jax.serving.policy.quality import QualitySnapshot
from dilaserve_jax.serving.policy.request import Request, RequestState
from dilaserve_jax.serving.policy.scheduler_config import (  # noqa: F401 - re-exported: the scheduler's API
    ADMISSION_MODES, OVERLOAD_RULES, OVERLOAD_RULES_OFF, POLICIES, AddResult, SchedulerConfig)
from dilaserve_jax.serving.policy.published_load import PublishedLoad
from dilaserve_jax.serving.policy.step_time import ScaledStepTime
from dilaserve_jax.serving.policy.threshold import Decision, ThresholdController
from dilaserve_jax.serving.policy.types import Admission, StepPlan
from dilaserve_jax.core.outcome import SlotOutcome
from dilaserve_jax.core.kinds import StepKind


class Scheduler(PublishedLoad):
    def __init__(self, config: SchedulerConfig, latency: LatencyModel,
                 controller: ThresholdController | None = None) -> None:
        self.cfg = config
        self.latency = latency
        self.controller = controller or ThresholdController(config.threshold)
        self.controller.preempting = config.adaptive and config.preempt_at_risk  # its plan counts on it
        self.controller.runs_ahead = config.adaptive and config.run_ahead
        self.requests: dict[str, Request] = {}  # unfinished
        self.waiting: list[Request] = []  # arrival order
        self.running: dict[int, Request] = {}  # slot -> request
        self.free_slots: list[int] = list(range(config.num_slots))
        self.decisions: dict[str, Decision] = {}
        self.lat_scale = {StepKind.REFRESH: 1.0, StepKind.REUSE: 1.0}  # updated in place (step_times reads it)
        self.step_times = ScaledStepTime(self._model_step_time, self.lat_scale)  # what the controller prices with
        self._aborts: list[str] = []
        self._releases: list[int] = []
        self._finished: list[Request] = []
        self.fill = LastBlockFill()  # how much of their last block finished requests decoded (published)
        self.outcomes = RecentOutcomes()  # finishes and deadlines met (published: the controller's feedback)
        self._memo: dict[tuple, float] = {}  # the latency model's step times (before the online correction)
        self._init_published()

    # --- latency ---
    def set_latency_model(self, latency: LatencyModel) -> None:
        """Replace the step-latency model (e.g. after measuring the instance at start-up)."""
        self.latency = latency
        self._memo.clear()
        self.controller.invalidate()

    def step_time(self, kind: StepKind, batch: int, req: Request) -> float:
        """Seconds per round in which each of `batch` requests takes one step of `kind`: one batch,
        or smaller ones back to back where the measured profile makes that cheaper (a CPU); the
        latency model's time times the online correction."""
        return self._model_step_time(kind, batch, req) * self.lat_scale[kind]

    def _model_step_time(self, kind: StepKind, batch: int, req: Request) -> float:
        key = (kind, batch, req.canvas_length, req.block_length)
        t = self._memo.get(key)
        if t is None:
            t = self._memo[key] = self.latency.round_seconds(kind, batch, req.canvas_length, req.block_length,
                                                             self.cfg.tp)
        return t

    def _feasible(self, req: Request, now: float, batch: int) -> bool:
        return self.controller.feasible_at(req, now, batch, self.step_times)

    # --- requests in ---
    def add(self, req: Request, now: float | None = None, speed_ratio: float | None = None) -> AddResult:
        """Queue a new request (admission control may reject it), or take over one that moved here
        from another instance (always accepted: it was admitted once; `speed_ratio` carries its
        tokens-per-step ratio from there)."""
        now = req.arrival if now is None else now
        if req.id in self.requests:
            raise ValueError(f"duplicate request id {req.id!r}")
        if req.state not in (RequestState.WAITING, RequestState.MIGRATING):
            raise ValueError(f"request {req.id} is {req.state.name}, expected WAITING or MIGRATING")
        if req.moves:
            if speed_ratio is not None:
                self.controller.ratios[req.id] = speed_ratio
            self.requests[req.id] = req
            self.waiting.append(req)
            return AddResult(True)
        reason = None
        if len(self.waiting) >= self.cfg.max_queue:
            reason = f"queue full ({len(self.waiting)} waiting, max_queue={self.cfg.max_queue})"
        elif self.cfg.strict_for(req) and req.deadline <= now:
            reason = "deadline already passed (strict admission)"
        elif self.cfg.strict_for(req) and not self._feasible(req, now, 1):
            low = self.controller.lowest_tau(req)
            need = self.controller.remaining_time(req, low, 1, self.step_times)
            at = f"tau_min={req.tau_min}" if low == req.tau_min else f"tau={low} (the lowest the accuracy budget allows)"
            reason = (f"deadline infeasible even at {at} on an idle instance "
                      f"(needs {need:.3g}s, has {req.deadline - now:.3g}s; strict admission)")
        if reason is not None:
            req.reject_reason = reason
            req.transition(RequestState.FINISHED_REJECTED, now)
            self._finished.append(req)
            return AddResult(False, reason)
        self.requests[req.id] = req
        self.waiting.append(req)
        return AddResult(True)

    def detach(self, req_id: str, now: float) -> tuple[Request, float | None]:
        """Take a request off this instance at a step boundary, unfinished (to move it elsewhere):
        its slot is released with the next plan. Returns it and its tokens-per-step ratio."""
        req = self.requests.pop(req_id)
        if req.slot is None:
            self.waiting.remove(req)
            self._left_queue(req_id)
        elif self.running.get(req.slot) is req:
            self._free_slot(req.slot)
        if req_id in self._aborts:
            self._aborts.remove(req_id)
        ratio = self.controller.ratios.get(req_id)
        self.decisions.pop(req_id, None)
        self.controller.forget(req_id)
        req.detach(now)
        return req, ratio

    def invalidate_caches(self) -> None:
        """After new weights: every running request's cached K/V is stale, so its next step refreshes."""
        for r in self.running.values():
            r.needs_refresh = True

    def abort(self, req_id: str) -> bool:
        """Mark for abort; applied (slot released) at the next `schedule`."""
        req = self.requests.get(req_id)
        if req is None or req.finished or req_id in self._aborts:
            return False
        self._aborts.append(req_id)
        return True

    # --- the round ---
    def schedule(self, now: float) -> StepPlan | None:
        for rid in self._aborts:
            self._finish(self.requests[rid], RequestState.FINISHED_ABORTED, now)
        self._aborts.clear()
        if self.cfg.drop_expired:
            for req in [*self.running.values(), *self.waiting]:
                if req.deadline < now:
                    self.outcomes.observe(now, False, now - req.arrival)
                    self._finish(req, RequestState.FINISHED_DEADLINE, now)
        if self.cfg.adaptive:
            self.decisions = self.controller.plan(list(self.running.values()), self.waiting, now,
                                                  self.cfg.num_slots, self.step_times)
        admits = self._admit(now)
        releases, self._releases = tuple(self._releases), []  # (with the slots preempted for admits)
        kind, batch, limit = self._pick_batch(now)
        if not (batch or admits or releases):
            return None
        taus = tuple(self._tau(r) for r in batch)
        in_batch = {r.id for r in batch}
        # a skip counts as the share of a round a request is due: where the batch is split (the
        # cheapest split takes `limit` of the running requests), a turn every few rounds is fair
        share = min(1.0, limit / len(self.running)) if self.running else 1.0
        for r in self.running.values():
            r.steps_skipped = 0 if r.id in in_batch else r.steps_skipped + share * self._skip_weight(r)
        return StepPlan(now, kind if batch else None, tuple(r.slot for r in batch), tuple(r.id for r in batch),
                        taus, admits, releases, tuple(r.block_index for r in batch))

    def _tau(self, req: Request) -> float:
        if self.cfg.adaptive:
            return self.decisions[req.id].tau
        return min(req.tau_max, max(req.tau_min, self.cfg.static_tau))

    def _skip_weight(self, req: Request) -> float:
        """How much one skip counts towards starvation: a request at risk passed over for requests
        still in time is the victim rule at work, not neglect, so it counts a fraction."""
        return self.cfg.at_risk_skip_share if self.cfg.adaptive and req.at_risk else 1.0

    def _starved(self, req: Request) -> bool:
        return req.steps_skipped >= self.cfg.max_skip

    def _order_key(self, now: float):
        if self.cfg.policy == "fcfs-static":
            return lambda r: (not self._starved(r), r.arrival)
        if self.cfg.policy == "edf-static":
            return lambda r: (not self._starved(r), r.deadline, r.arrival)

        def least_slack(r: Request):  # slack left after finishing at the chosen τ
            d = self.decisions.get(r.id)
            if self.cfg.shortest_late_first:
                if self._starved(r):  # starved ones in arrival order, or a stream of short late ones starves a long one
                    return (False, False, r.arrival, r.arrival)
                if r.at_risk and d is not None:  # late anyway: the shortest first keeps the mean latency low
                    return (True, True, d.predicted_finish - d.predicted_start, r.arrival)
            return (not self._starved(r), r.at_risk, d.slack_if_started(r.deadline, now) if d else r.deadline - now,
                    r.arrival)
        return least_slack

    def _fits(self, group: list[Request], cand: Request, now: float, admitting: bool = False) -> bool:
        """Would every feasible member of group + cand still meet its deadline at the larger batch?

        For admission the batch counts only feasible running requests: at-risk ones join a step
        only when it fits anyway."""
        b = (sum(not r.at_risk for r in group) if admitting else len(group)) + 1
        members = group if cand.at_risk else [*group, cand]
        if all(r.at_risk or self._feasible(r, now, b) for r in members):
            return True
        return admitting and self.cfg.run_ahead and not cand.at_risk and self._runs_ahead(group, cand, now, b - 1)

    def _runs_ahead(self, group: list[Request], cand: Request, now: float, batch: int) -> bool:
        """Can `cand` run alone first (least slack first puts it there) and every feasible member
        of group still make it, delayed by its time?"""
        ahead = now + self.controller.remaining_time(cand, self.controller.lowest_tau(cand), 1, self.step_times)
        return ahead <= cand.deadline and all(r.at_risk or self._feasible(r, ahead, batch) for r in group)

    def _admit(self, now: float) -> tuple[Admission, ...]:
        preempt = self.cfg.adaptive and self.cfg.preempt_at_risk
        if not self.waiting or not (self.free_slots or preempt):
            return ()
        key = self._order_key(now)
        first, risky = self.waiting, []
        if self.cfg.adaptive:  # the at-risk ones (not starved) come last in the order anyway
            # starvation lets at-risk requests go first into a bounded number of slots only
            bound = self.cfg.starved_at_risk_slots
            jump = bound is None or sum(r.at_risk for r in self.running.values()) < bound
            first = [w for w in self.waiting if not w.at_risk or (jump and self._starved(w))]
            risky = [w for w in self.waiting if w.at_risk and not (jump and self._starved(w))]
        admits = []
        for w in sorted(first, key=key):
            if not self.free_slots and not (preempt and not w.at_risk):
                break
            group = list(self.running.values())
            if self.cfg.adaptive and group and not self._starved(w) and not self._fits(group, w, now, admitting=True):
                continue
            if not self.free_slots and not self._preempt_one(now, admits):
                break
            admits.append(self._start(w, now))
        # an at-risk request joins only where the group has room for one more at-risk request, the
        # same question for each of them: the queue is sorted only when one can be admitted
        order = None
        while risky and self.free_slots:
            group = list(self.running.values())
            if group and not self._fits(group, risky[0], now, admitting=True):
                break
            if order is None:
                order = sorted(risky, key=key)[::-1]  # popped from the end
            admits.append(self._start(order.pop(), now))
            risky = order
        for w in self.waiting:  # passed over while a slot was free: counts towards starvation
            w.steps_skipped += self._skip_weight(w)
        return tuple(admits)

    def _preempt_one(self, now: float, admits: list[Admission]) -> bool:
        """Free a slot for a request in time by sending a running one at risk back to the queue
        (not a starved one, nor one admitted this round): the one with the most work left, so the
        lost requests nearest their end still finish first. False when there is none."""
        new = {a.slot for a in admits}
        victims = [r for r in self.running.values() if r.at_risk and not self._starved(r) and r.slot not in new]
        if not victims:
            return False
        d = self.decisions

        def work_left(r: Request):
            return self.request_time(r, 1, d[r.id].tau if r.id in d else r.tau_min), r.arrival
        victim = max(victims, key=work_left)
        self._free_slot(victim.slot)
        victim.preempt(now)
        bisect.insort(self.waiting, victim, key=lambda r: r.arrival)
        return True

    def _start(self, w: Request, now: float) -> Admission:
        slot = self.free_slots.pop(0)
        self.waiting.remove(w)
        self._left_queue(w.id)
        w.transition(RequestState.RUNNING, now)
        w.slot, w.needs_refresh, w.steps_skipped = slot, True, 0
        self.running[slot] = w
        return Admission(slot, w.id, w.prompt_tokens, w.answer_length, w.block_length,
                         w.temperature, w.seed, w.committed_answer, len(w.steps))

    def _pick_batch(self, now: float) -> tuple[StepKind | None, list[Request], int]:
        """The step's kind, its requests, and the size limit it was picked under."""
        if not self.running:
            return None, [], self.cfg.batch_limit
        order = sorted(self.running.values(), key=self._order_key(now))
        kind = order[0].next_kind  # the most urgent (or starved) request decides the kind
        limit = self.cfg.batch_limit
        if self.cfg.adaptive:  # no larger than the cheapest split of the ready requests (see step_time)
            ready = sum(r.next_kind == kind for r in order)
            first = order[0]
            limit = min(limit, max(1, self.latency.best_batch(kind, ready, first.canvas_length, first.block_length,
                                                              self.cfg.tp)))
        batch: list[Request] = []
        for r in order:
            if r.next_kind != kind or len(batch) >= limit:
                continue
            if self.cfg.adaptive and batch and not self._starved(r) and not (
                    (not r.at_risk or self._rides_cheaply(kind, batch, r)) and self._fits(batch, r, now)):
                continue
            batch.append(r)
        return kind, batch, limit

    def _rides_cheaply(self, kind: StepKind, batch: list[Request], r: Request) -> bool:
        """Whether at-risk `r` joining makes the step at most `rider_cost` longer (always, when
        every member is at risk too): a rider that costs more spends the slack of the requests in
        time, which the next arrivals need."""
        if self.cfg.rider_cost == math.inf or all(m.at_risk for m in batch):
            return True
        longest = max((*batch, r), key=lambda m: m.canvas_length)
        canvas, block, tp = longest.canvas_length, longest.block_length, self.cfg.tp
        return (self.latency.predict(kind, len(batch) + 1, canvas, block, tp)
                <= self.latency.predict(kind, len(batch), canvas, block, tp) * (1 + self.cfg.rider_cost))

    # --- results in ---
    def update(self, plan: StepPlan, outcomes: list[SlotOutcome], now: float) -> list[Request]:
        """Apply one step's outcomes; returns the requests that finished with it."""
        if not plan.has_step:
            return []
        if len(outcomes) != len(plan.slots):
            raise ValueError(f"{len(outcomes)} outcomes for {len(plan.slots)} slots")
        duration = now - plan.time
        self._correct_latency(plan, duration)
        done = []
        for o, rid, tau in zip(outcomes, plan.request_ids, plan.taus):
            req = self.running.get(o.slot)
            if req is None or req.id != rid:
                raise ValueError(f"outcome for slot {o.slot} does not match plan request {rid}")
            req.record_step(plan.kind, tau, o.n_committed, o.block_finished, now, duration, o.positions, o.tokens)
            self.controller.observe(req, tau, o.n_committed, o.block_finished or o.request_finished,
                                    confidence_counts=o.confidence_counts, max_confidence=o.max_confidence)
            if o.request_finished:
                self.fill.observe(req.committed, req.answer_length, req.block_length)
                self.outcomes.observe(now, now <= req.deadline, now - req.arrival)
                req.output_tokens = list(o.answer)
                self._finish(req, RequestState.FINISHED_OK, now)
                done.append(req)
        return done

    def _correct_latency(self, plan: StepPlan, duration: float) -> None:
        a = self.cfg.latency_ema
        if a == 0 or duration <= 0:
            return
        reqs = [self.running[s] for s in plan.slots]
        longest = max(reqs, key=lambda r: r.canvas_length)
        pred = self.latency.predict(plan.kind, len(reqs), longest.canvas_length, longest.block_length, self.cfg.tp)
        if pred > 0:
            ratio = min(10.0, max(0.1, duration / pred))
            old = self.lat_scale[plan.kind]
            self.lat_scale[plan.kind] = old + a * (ratio - old)
            if self.lat_scale[plan.kind] != old:
                self.controller.rescaled()  # its memoised times were priced at the old correction

    def _finish(self, req: Request, state: RequestState, now: float) -> None:
        if req.slot is None:
            self.waiting.remove(req)
            self._left_queue(req.id)
        elif self.running.get(req.slot) is req:
            self._free_slot(req.slot)
        req.transition(state, now)
        self.requests.pop(req.id, None)
        self.decisions.pop(req.id, None)
        self.controller.forget(req.id, req.predicted_loss if state == RequestState.FINISHED_OK else None)
        self._finished.append(req)

    def _free_slot(self, slot: int) -> None:
        del self.running[slot]
        self.free_slots.append(slot)
        self.free_slots.sort()
        self._releases.append(slot)

    # --- introspection ---
    def pop_finished(self) -> list[Request]:
        """Requests finished (ok, aborted, rejected, dropped) since the last call."""
        out, self._finished = self._finished, []
        return out

    @property
    def idle(self) -> bool:
        return not (self.running or self.waiting or self._aborts or self._releases)

    def quality(self) -> QualitySnapshot | None:
        """Budget, predicted loss spent and mean τ (None without an accuracy model)."""
        return self.controller.quality_snapshot()

    def request_time(self, req: Request, batch: int, tau: float | None = None) -> float:
        return self.controller.remaining_time(req, req.tau_max if tau is None else tau, batch, self.step_times)
