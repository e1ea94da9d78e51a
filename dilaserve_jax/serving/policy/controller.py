"""The cluster controller: which layout to run, and which requests to move (pure; no JAX).

Every `interval_s` the cluster (or the simulator) calls `decide(now, current, snapshots)`:

- **Load estimate.** Arrivals reported with `observe` over a sliding window give the rate and a
  sample of recent request shapes (prompt and answer lengths, block, SLO, τ range).
- **Candidates.** Every partition of the devices into power-of-two TP groups the model allows
  (`tp_degrees`), or only the layouts given (`--layouts`).
- **Prediction.** `layout_eval.evaluate_layouts`: per TP degree, the latency model (refresh and reuse
  steps costed apart, a round priced as the decoder runs it: one padded step per length bucket
  present in the batch, `StepShapes`), the τ -> tokens/step estimate the instances publish, and
  the router's equal-latency split give each candidate's SLO attainment, mean latency and mean τ.
- **Bursts.** The chain prices a steady (Poisson) load; arrivals that bunch within the window are
  counted in bins (`burst_bin_slos` median SLOs long, 1 s to a quarter of the window), each bin's
  rate shrunk towards the mean by the share of the counts' variance Poisson noise explains, and
  each share of the arrivals is priced at the rate of the bins it came in (`spread`,
  `bursts.burst_spread`): on the sped-up code trace a window at 60 req/s holds seconds at
  several times that, and the mean rate alone predicted 86-94% where the layout realised 45-77%.
  Poisson arrivals show no excess and are priced at the mean as before.
- **Feedback** (`feedback.py`). The prediction for the layout being served is checked against
  what it realises over the last `feedback_window_s` (since it began serving), which the
  instances publish (outcomes.py). Attainment (off by default, `feedback_min_requests`): when it
  realises clearly less than predicted, every candidate is priced at the rate where the current
  layout's prediction falls to what it realised (the others are compared at the same corrected
  load, so one optimistic model does not favour the layout it is wrong about). Latency (on by
  default, `latency_feedback_requests`): its realised mean latency over its prediction,
  remembered per layout at the rate it was measured at, scales that layout's predicted latency
  while the load stays near that rate.
- **Objective.** attainment + `tau_weight`·mean τ − `latency_weight`·latency/latency_now: deadlines
  first, then quality, then speed (at low load every layout meets every deadline at τ_max and the
  widest instances finish soonest; at high load narrow instances keep τ high). While the current
  layout keeps up, no switch gives up more than `switch_attainment_tolerance` of predicted
  attainment for speed or τ.
- **Switching cost.** Bytes that must move (`core.layouts.moved_fraction` of the model per device) at
  `bandwidth_gbps`, building each new instance (`load_s`) plus compiling the placements never
  compiled (`compile_s`; on a GPU with the persistent compile cache a TP degree compiled once is
  compiled for every placement, see `JaxInstanceBuilder.compiled_placements`), and the pause of the
  requests in flight (a step boundary plus a refresh). Requests whose slack is below the pause are
  charged as misses; the gain counts only after the switch completes, over `horizon_s`.
- **Decision.** Switch when the predicted gain beats the cost by `hysteresis`, the same layout won
  `confirmations` rounds in a row by that margin, and `min_dwell_s` passed since the last switch, so it does not
  flap. No switch before the load estimate is trusted: `min_arrivals` in the window, and one full
  `window_s` since the first arrival (a rate from the first few seconds of a burst says little, and
  a switch costs a recompilation and a pause). Nor while the load is still moving: when the rate
  over the window's last half differs from the window's rate by more than `settle_tolerance` (25%)
  and by more than 3 Poisson standard deviations, the window rate lags a ramp and a switch would
  land on a layout for a load already gone (then dwell), so the decision waits for the window to
  catch up. Unless the load jumped to a new level and held it: when the last half-window's own
  last half agrees with it, the decision prices that half's rate at once, and switches only for a
  gain beyond the cost by `level_shift_gain` (0.1), so that small swings still wait for the window.
  Every decision carries its reason and predictions, kept in `history`.
- **Refinement** (`refinement.py`; off by default): with `refine_candidates` and a refiner the host
  supplies (the simulator's), only the current layout and the chain's best few compete, each
  priced by replaying the recent arrivals on it.
- **Migration.** `plan_migrations` (`migration.py`): a request at risk on one instance (it cannot meet its deadline
  there even at its τ floor) moves at the next step boundary to an instance with a free slot and
  an empty queue whose estimate says it will meet it there.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from typing import Mapping, Sequence

from dilaserve_jax.core.layouts import binary_partitions, layout_text, moved_fraction, parse_layout
from dilaserve_jax.serving.policy.bursts import burst_spread
from dilaserve_jax.serving.policy.capacity import RequestShape, StepShapes, instance_curves, with_latency_of
from dilaserve_jax.serving.policy.controller_config import (  # noqa: F401 - re-exported: the controller's API
    AtRisk, ControllerConfig, Decision, Migration)
from dilaserve_jax.serving.policy.latency import LatencyModel
from dilaserve_jax.serving.policy.feedback import LatencyMemory, checked_rate
from dilaserve_jax.serving.policy.layout_eval import LayoutPrediction, evaluate_layouts
from dilaserve_jax.serving.policy.load_window import load_moved, quantile_sample, rate_since
from dilaserve_jax.serving.policy.migration import MigrationPlanner
from dilaserve_jax.serving.policy.refinement import Refinement
from dilaserve_jax.serving.policy.switch_cost import build_seconds
from dilaserve_jax.serving.policy.threshold_config import DEFAULT_PRIOR
from dilaserve_jax.core.kinds import StepKind


class ClusterController:
    def __init__(self, cfg: ControllerConfig, *, num_devices: int, tp_degrees: Sequence[int],
                 latency: LatencyModel | Mapping[int, LatencyModel], slots: int, param_bytes: int,
                 layouts: Sequence[str | Sequence[int]] | None = None, tau_floor: float = 0.5,
                 prior: Mapping[float, float] | None = None, shapes: StepShapes | None = None,
                 pressure_share: float | None = None) -> None:
        self.cfg = cfg
        self.shapes = shapes  # how the decoder batches (buckets); None: one batch at each request's canvas
        # the instances' arrival-pressure share (ThresholdConfig.pressure_at_risk_share): a loaded
        # instance runs everyone at `tau_floor`, the budget's floor (None: instances do not)
        self.pressure_share = pressure_share
        self.num_devices, self.slots, self.param_bytes, self.tau_floor = num_devices, slots, param_bytes, tau_floor
        self.tp_degrees = tuple(sorted(t for t in set(tp_degrees) if t <= num_devices))
        if not self.tp_degrees:
            raise ValueError(f"no usable TP degree among {tp_degrees} for {num_devices} devices")
        self._latency = latency
        missing = [t for t in self.tp_degrees if not self._has_fit(t)]
        if missing:
            raise ValueError(f"the latency model has no fit for TP {missing}; profile those degrees first")
        self.candidates = self._candidates(layouts)
        prior = dict(prior or DEFAULT_PRIOR)
        self.taus = tuple(sorted(prior, reverse=True))
        self.tokens_per_step = tuple(prior[t] for t in self.taus)
        # the instances' estimate (answer_fill.py), priced only with `cfg.price_answer_ends` (everything)
        # or `cfg.latency_at_answer_ends` (the mean latency)
        self.last_block_fill = 1.0
        self._arrivals: deque[tuple[float, RequestShape]] = deque()
        self._first_arrival: float | None = None  # the load estimate is trusted after one full window
        self._lock = threading.Lock()  # arrivals are reported from other threads
        self.history: deque[Decision] = deque(maxlen=64)
        self.last_switch: float | None = None
        self._streak: tuple[str, int] = ("", 0)
        self.migrations = MigrationPlanner(cfg)
        self.refinement: Refinement | None = None  # refinement by replay (refinement.py), when a host supplies one
        self.latency_memory = LatencyMemory(min_requests=cfg.latency_feedback_requests,
                                            smoothing=cfg.latency_feedback_smoothing,
                                            rate_tolerance=cfg.latency_memory_rate_tolerance,
                                            memory_s=cfg.latency_memory_s)

    # --- inputs ---
    def observe(self, shape: RequestShape, now: float) -> None:
        """An arrival (any thread)."""
        with self._lock:
            self._arrivals.append((now, shape))
            if self._first_arrival is None:
                self._first_arrival = now

    def set_last_block_fill(self, fill: float) -> None:
        """The instances' pooled share of the last block their requests decode (answer_fill.py)."""
        if not 0.0 < fill <= 1.0:
            raise ValueError(f"last block fill must be in (0, 1], got {fill}")
        self.last_block_fill = fill

    def set_tokens_per_step(self, taus: Sequence[float], rates: Sequence[float], *, smooth: bool = True) -> None:
        """The instances' online τ -> tokens/step estimate (any order of τ); `smooth=False`: taken as
        it is (a settled estimate, as the calibration computes it)."""
        pairs = sorted(zip(taus, rates), reverse=True)
        new_taus, new_rates = tuple(t for t, _ in pairs), tuple(max(1.0, r) for _, r in pairs)
        if smooth and new_taus == self.taus:  # smoothed over rounds (from the prior): the estimate follows the
            a = self.cfg.tokens_per_step_smoothing  # requests in flight, which turn over every few steps
            new_rates = tuple(a * r + (1 - a) * o for r, o in zip(new_rates, self.tokens_per_step))
        self.taus, self.tokens_per_step = new_taus, new_rates

    def load(self, now: float) -> tuple[float, list[RequestShape]]:
        """(arrival rate over the window, up to `sample_size` request shapes spread over it)."""
        with self._lock:
            while self._arrivals and self._arrivals[0][0] < now - self.cfg.window_s:
                self._arrivals.popleft()
            recent = list(self._arrivals)
        if not recent:
            return 0.0, []
        span = min(self.cfg.window_s, max(now - recent[0][0], self.cfg.interval_s))
        rate, k = len(recent) / span, self.cfg.sample_size
        shapes = [s for _, s in recent]
        if len(shapes) > k:  # the window's quantiles of work (`load_window.quantile_sample`)
            shapes = quantile_sample(shapes, k)
        return rate, shapes

    def load_moving(self, now: float) -> str | None:
        """Why the window's rate is not yet the load (it lags a ramp), or None when it has settled:
        the rate over the window's last half against the whole window's (see the module doc). A
        load that jumped to a new level and stayed there for the last half-window (whose own last
        half agrees with it) has settled too: `decide` then prices the last half's rate."""
        tol = self.cfg.settle_tolerance
        if tol is None:
            return None
        w = self.cfg.window_s
        times = self._times(now)
        moved = load_moved(times, now, w, tol)
        if moved is None or self._level(times, now) is not None:
            return None
        recent, whole = moved
        return (f"{recent:.1f} req/s over the last {w / 2:g} s against {whole:.1f} over {w:g} s "
                f"(settled within {100 * tol:.0f}%)")

    def _since(self, start: float) -> list[tuple[float, RequestShape]]:
        with self._lock:
            return [(t, s) for t, s in self._arrivals if t >= start]

    def _times(self, now: float) -> list[float]:
        return [t for t, _ in self._since(now - self.cfg.window_s)]

    def _level(self, times: Sequence[float], now: float) -> float | None:
        """The last half-window's rate when the window's rate lags it but the last half itself has
        settled (a jump to a new level, not a ramp still moving); None otherwise."""
        w, tol = self.cfg.window_s, self.cfg.settle_tolerance
        if self.cfg.level_shift_gain is None or tol is None or load_moved(times, now, w, tol) is None:
            return None
        if load_moved(times, now, w / 2, tol) is not None:
            return None
        return rate_since(times, now, w / 2)

    # --- the layout decision ---
    def predict(self, rate: float, sample: Sequence[RequestShape],
                layouts: Sequence[tuple[int, ...]] | None = None, curves: Mapping | None = None,
                spread: Sequence[tuple[float, float]] | None = None,
                latency_margin: float | None = None) -> list[LayoutPrediction]:
        """`curves`: the sample's per-TP curves when made already (`_curves`); `spread`: the
        window's bursts (`spread`), None to price every arrival at `rate`; `latency_margin`: the mean
        latency is read at `rate` times 1 + this (None: `latency_rate_margin`, as the decision
        weighs it; 0: the prediction at the rate itself)."""
        layouts = list(self.candidates if layouts is None else layouts)
        curves = self._curves(sample, layouts) if curves is None else curves
        preds = evaluate_layouts(layouts, curves, rate, spread=spread)
        margin = self.cfg.latency_rate_margin if latency_margin is None else latency_margin
        if margin and rate > 0:  # the latency a little past the load (ControllerConfig.latency_rate_margin)
            past = evaluate_layouts(layouts, curves, rate * (1.0 + margin), spread=spread)
            preds = [dataclasses.replace(p, latency_s=q.latency_s) for p, q in zip(preds, past)]
        return preds

    def spread(self, now: float, sample: Sequence[RequestShape]) -> list[tuple[float, float]] | None:
        """With `price_bursts`: how the window's arrivals bunch, as `bursts.burst_spread` gives it
        over bins `burst_bin_slos` times the sample's median SLO long (at least 1 s, at most a
        quarter of the window); None when off, or when the arrivals are Poisson-like.

        The bins are long against the SLO because each is priced as a steady load: a burst of
        length L at rate λ above the capacity C serves about C·(L + SLO) of its λ·L requests in
        time (the queue it leaves drains after it), the chain C·L; and a bin much shorter than the
        SLO prices as lost requests that a quiet bin after it would serve."""
        if not self.cfg.price_bursts or not sample:
            return None
        slos = sorted(r.slo_s for r in sample)
        span = self.cfg.window_s
        if self._first_arrival is not None:  # before a full window, only the time arrivals were seen for
            span = min(span, now - self._first_arrival)
        bin_s = min(max(slos[len(slos) // 2] * self.cfg.burst_bin_slos, 1.0), span / 4)
        return burst_spread(self._times(now), now - span, now, bin_s, self.cfg.burst_levels)

    def _curves(self, sample: Sequence[RequestShape], layouts: Sequence[tuple[int, ...]]) -> dict:
        def curves(tp: int, fill: float):
            return instance_curves(self._model(tp), tp, sample, self.slots, self.taus, self.tokens_per_step,
                                   tau_floor=self.tau_floor, target_utilisation=self.cfg.target_utilisation,
                                   shapes=self.shapes, pressure_share=self.pressure_share, last_block_fill=fill,
                                   late_wait_rounds=self.cfg.late_wait_rounds or None)
        fill = self.last_block_fill
        priced = fill if self.cfg.price_answer_ends else 1.0  # deadlines and τ
        out = {}
        for tp in sorted({t for lay in layouts for t in lay}):
            out[tp] = curves(tp, priced)
            if self.cfg.latency_at_answer_ends and fill < priced:  # the latency where answers end
                out[tp] = with_latency_of(out[tp], curves(tp, fill))
        return out

    def feedback_since(self, now: float) -> float:
        """Outcomes from this time on count as the current layout's (see `decide`'s `realised`)."""
        start = now - self.cfg.feedback_window_s
        return start if self.last_switch is None else max(start, self.last_switch)

    def decide(self, now: float, current: Sequence[int], *, in_flight_slack: Sequence[float] = (),
               compiled: frozenset[tuple[int, int]] = frozenset(),
               realised: tuple[int, int] | None = None,
               realised_latency: tuple[float, int] | None = None) -> Decision:
        """Choose the layout for the next period. `in_flight_slack`: deadline - now of the requests
        in flight (charged if a switch would pause them past it); `compiled`: (TP, first device)
        placements whose executables exist; `realised`: (met, counted) of the requests the current
        layout finished since `feedback_since(now)` plus those in flight past their deadline;
        `realised_latency`: (mean latency s, count) of those that arrived since then and finished."""
        t0 = time.perf_counter()
        current = tuple(sorted(current, reverse=True))
        cur_text = layout_text(current)
        rate, sample = self.load(now)
        times = self._times(now)
        level = self._level(times, now) if sample else None
        whole_window = True  # the priced rate is the window's mean
        if level is not None:
            rate, whole_window = level, False
        elif self._first_arrival is not None and now - self._first_arrival >= self.cfg.window_s:
            # a load that rose within the window is priced at its last half: the window's mean lags a
            # rise by up to half a window, and under-providing costs more than over-providing
            half = rate_since(times, now, self.cfg.window_s / 2)
            if half > rate:
                rate, whole_window = half, False
        if len(sample) < 1:
            return self._record(Decision(now, cur_text, cur_text, False, "no arrivals in the window", rate,
                                         seconds=time.perf_counter() - t0))
        layouts = list(dict.fromkeys([current, *self.candidates]))
        arrival_rate = rate
        curves = self._curves(sample, layouts)  # once: the check and the prediction share them
        # a rate read off the last half-window is a jump or a rise, which that rule prices already:
        # the bursts are read only on a window whose mean is the rate
        spread = self.spread(now, sample) if whole_window else None
        rate, got = checked_rate(self.cfg, current, curves, rate, realised, spread)
        preds = {p.layout: p for p in self.predict(rate, sample, layouts, curves, spread=spread)}
        checked = "" if rate == arrival_rate else (f" [priced at {rate:.1f} req/s, not {arrival_rate:.1f}: "
                                                   f"{cur_text} realised {got:.1%}, below its prediction]")
        # latency is measured on a steady window only: under bursts (or a rise priced at the last
        # half) what a layout realises swings with the bursts, not with the model's error
        steady = whole_window and spread is None
        measured = self.latency_memory.observe(current, now, rate, preds[current].latency_s,
                                               realised_latency if steady else None)
        preds = self.latency_memory.correct(preds, rate, now)
        if measured is not None:
            checked += f" [{cur_text} latency x{measured.ratio:.2f} as realised]"
        if self.refinement is not None and self.cfg.refine_candidates:
            preds, replayed = self.refinement.shortlist(now, current, preds, self._since)
            checked += replayed
        now_pred = preds[current]
        ref_lat = now_pred.latency_s  # (value() guards a zero)

        def value(p: LayoutPrediction) -> float:
            return self.cfg.value(p.attainment, p.tau, p.latency_s, ref_lat)

        by_value = sorted(preds.values(), key=lambda p: (value(p), p.layout == current), reverse=True)
        # deadlines first: while the current layout keeps up, no switch to one predicted to meet
        # fewer of them (beyond the tolerance) for its speed or τ; latency is least reliable near
        # capacity, where those trades are offered. Past its capacity the chain's attainment does not
        # see the backlog and its latency does, so there speed decides (switch_attainment_tolerance)
        floor = now_pred.attainment - self.cfg.switch_attainment_tolerance if now_pred.backlog_s <= 0 else -1.0
        ranked = [p for p in by_value if p.layout == current or p.attainment >= floor]
        best = ranked[0]
        # the layout a streak is confirming stays the target while it is within the hysteresis of the
        # round's best: near-equal candidates trade first place from round to round with the sample
        held = next((p for p in ranked if layout_text(p.layout) == self._streak[0]), None)
        if held is not None and best.layout != current and value(held) >= value(best) - self.cfg.hysteresis:
            best = held
        predicted = {layout_text(p.layout): (p.attainment, p.latency_s, p.tau) for p in [best, *by_value[:3]]}
        predicted.setdefault(cur_text, (now_pred.attainment, now_pred.latency_s, now_pred.tau))
        if best.layout == current:
            self._streak = ("", 0)
            return self._record(Decision(now, cur_text, cur_text, False, "the current layout predicts best" + checked,
                                         rate, predicted, seconds=time.perf_counter() - t0, realised=got))
        switch_s, pause_s = self.switch_seconds(current, best.layout, sample, compiled)
        # charged as misses: requests in flight with less slack than the pause, and the share of the
        # arrivals during the pause whose SLO is that tight
        missed = sum(1 for s in in_flight_slack if s < pause_s)
        tight = sum(1 for r in sample if r.slo_s < 2 * pause_s) / len(sample)
        arrivals = rate * self.cfg.horizon_s
        cost = (missed + rate * pause_s * tight) / max(1.0, arrivals)
        gain = (value(best) - value(now_pred)) * max(0.0, 1.0 - switch_s / self.cfg.horizon_s)
        best_text = layout_text(best.layout)
        margin = self.cfg.hysteresis if level is None else max(self.cfg.hysteresis, self.cfg.level_shift_gain)
        # a round confirms a switch only when the same layout wins it by the margin: predictions
        # move with the sample, and a layout that wins by the margin one round in two is noise
        streak = self._streak[1] + 1 if self._streak[0] == best_text else 1
        self._streak = (best_text, streak) if gain > cost + margin else ("", 0)
        if gain <= cost + margin:
            reason = (f"gain {gain:.3f} does not beat cost {cost:.3f} + "
                      + (f"hysteresis {margin:g}" if level is None else f"the level-shift margin {margin:g} (rate of "
                                                                      f"the last {self.cfg.window_s / 2:g} s)"))
        elif len(sample) < self.cfg.min_arrivals:
            reason = f"only {len(sample)} arrivals in the window (need {self.cfg.min_arrivals})"
        elif self._first_arrival is None or now - self._first_arrival < self.cfg.window_s:
            seen = 0.0 if self._first_arrival is None else now - self._first_arrival
            reason = (f"load estimate not trusted yet: {seen:.0f} s of arrivals seen, a full {self.cfg.window_s:g} s "
                      f"window needed")
        elif (moving := self.load_moving(now)) is not None:
            reason = f"load still changing: {moving}"
        elif self.last_switch is not None and now - self.last_switch < self.cfg.min_dwell_s:
            reason = f"dwell: {now - self.last_switch:.0f} s since the last switch (min {self.cfg.min_dwell_s:g} s)"
        elif streak < self.cfg.confirmations:
            reason = f"{best_text} won {streak} of {self.cfg.confirmations} rounds needed"
        else:
            self._streak = ("", 0)
            return self._record(Decision(now, cur_text, best_text, True,
                                         f"gain {gain:.3f} > cost {cost:.3f} + "
                                         f"{'hysteresis' if level is None else 'level-shift margin'}; "
                                         f"switch ~{switch_s:.1f} s" + checked,
                                         rate, predicted, cost, time.perf_counter() - t0, got))
        return self._record(Decision(now, cur_text, best_text, False, reason + checked, rate, predicted, cost,
                                     time.perf_counter() - t0, got))

    def switched(self, now: float) -> None:
        """The actuator applied a switch (manual ones too): the dwell time starts now."""
        self.last_switch = now
        self.latency_memory.switched()

    def latency_feedback_since(self, now: float, in_flight_slack: Sequence[float]) -> float | None:
        """Requests arriving from this time on and finished count as the current layout's realised
        latency (`decide`'s `realised_latency`); None: not yet (feedback.py)."""
        return self.latency_memory.since(now, self.feedback_since(now), in_flight_slack)

    def switch_seconds(self, old: Sequence[int], new: Sequence[int], sample: Sequence[RequestShape],
                       compiled: frozenset[tuple[int, int]] = frozenset()) -> tuple[float, float]:
        """(seconds until the new layout serves, pause of the requests in flight)."""
        move_bytes = moved_fraction(old, new) * self.param_bytes / max(1, max(new))
        switch_s = move_bytes / (self.cfg.bandwidth_gbps * 1e9) + build_seconds(old, new, compiled, self.cfg)
        refresh = max(self._model(max(new)).predict(StepKind.REFRESH, 1, r.canvas, r.block_len, max(new))
                      for r in sample) if sample else 0.0
        return switch_s, 2 * refresh

    # --- migration ---
    def plan_migrations(self, now: float, at_risk: Mapping[str, Sequence[tuple[AtRisk, str]]]) -> list[Migration]:
        """Moves for at-risk requests (`migration.MigrationPlanner.plan`)."""
        return self.migrations.plan(now, at_risk)

    # --- internals ---
    def _record(self, d: Decision) -> Decision:
        self.history.append(d)
        return d

    def _has_fit(self, tp: int) -> bool:
        model = self._latency.get(tp) if isinstance(self._latency, Mapping) else self._latency
        return model is not None and tp in model.tp_degrees

    def _model(self, tp: int) -> LatencyModel:
        return self._latency[tp] if isinstance(self._latency, Mapping) else self._latency

    def _candidates(self, layouts) -> list[tuple[int, ...]]:
        if layouts:
            out = [tuple(sorted(parse_layout(x) if isinstance(x, str) else x, reverse=True)) for x in layouts]
            bad = [layout_text(x) for x in out if sum(x) != self.num_devices or not set(x) <= set(self.tp_degrees)]
            if bad:
                raise ValueError(f"layouts {bad} do not cover the {self.num_devices} devices with TP degrees "
                                 f"{self.tp_degrees}")
            return list(dict.fromkeys(out))
        return binary_partitions(self.num_devices, self.tp_degrees)
