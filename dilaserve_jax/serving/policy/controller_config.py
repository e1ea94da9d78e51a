"""The cluster controller's configuration and the records it produces: its decisions (with the
predictions behind them), the migrations it plans, and the at-risk requests instances report
(see `controller.py`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from dilaserve_jax.core.cli import opt
from dilaserve_jax.serving.policy.scheduler_config import LATE_WAIT_ROUNDS


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    interval_s: float = opt(2.0, "seconds between the controller's decisions", name="--controller-interval-s")
    window_s: float = 30.0  # arrival-rate window
    horizon_s: float = 300.0  # how long a new layout is expected to pay off
    min_dwell_s: float = opt(30.0, "minimum seconds between two layout switches")
    hysteresis: float = 0.02  # objective gain (≈ attainment points / 100) needed beyond the cost
    # rounds in a row the same layout must win by the margin before a switch: rounds 2 s apart share
    # most of their sample, so two in a row confirmed a sample's fluke (a layout at the edge of its
    # capacity looked overloaded for one window and was left for 40 s: 2.5-3 points over 180 s)
    confirmations: int = 5
    min_arrivals: int = 8  # arrivals in the window before any switch
    settle_tolerance: float | None = 0.25  # no switch while the last half-window's rate is off by more (None: off)
    # a jump to a new level that has held for the last half-window is acted on at that half's rate,
    # before the window catches up, when the predicted gain beats the cost by this much (None: wait)
    level_shift_gain: float | None = 0.1
    # request shapes the prediction prices, spread evenly over the window: a heavy-tailed length mix
    # needs a few hundred for a stable mean service time, and rounds 2 s apart then share most of
    # their sample (the last 64 alone made the capacity swing by a sixth from round to round)
    sample_size: int = 256
    # price a request's last block at the share the instances report their requests decode before
    # the answer ends (answer_fill.py), not the whole block. Closer to the simulator at moderate load
    # (latency within 4% at 10 req/s instead of 18-32% high), but it loses at the edge of capacity:
    # on a step 20 -> 90 -> 20 req/s it chose 4x2 at the jump where 8x1 holds (-8 and -10 points on
    # two seeds of three; docs/simulation.md), so it is off by default
    price_answer_ends: bool = opt(False, "cluster controller: price each request's last block at the share of it "
                                         "the instances report answers decode before they end")
    # the same share for the mean latency alone: deadlines and τ stay priced at the whole block (pricing
    # them at the share lost the step above) and the latency term of the objective where answers end.
    # At 30 req/s it holds 2x4 (99.4%, 0.08 s) where the default holds 1x8 (98.7%, 0.10 s), but on the
    # diurnal load (--slo-tp 1) it serves 85.9% at 0.44 s against the default's 86.5% at 0.26 s, and on
    # the sped-up code trace 69.9% at 1.26 s against 70.3% at 1.11 s, so it is off by default
    # (docs/simulation.md, "Latency priced where answers end")
    latency_at_answer_ends: bool = opt(False, "cluster controller: predict mean latencies with each request's last "
                                              "block priced at the share the instances report answers decode "
                                              "(deadlines and τ stay priced at the whole block)")
    # the mean latency the decision weighs is read at the arrival rate times (1 + this margin), the
    # attainment and τ at the rate itself: a latency curve is steep near a layout's capacity, where an
    # error of a tenth in the modelled capacity doubles the latency, so a layout is preferred for its
    # speed only where it stays fast a little past the load it sees (docs/simulation.md, "The
    # conversation-style mix at 180 s, and latency read past the load": off, as it loses at 70 req/s)
    latency_rate_margin: float = opt(0.0, "cluster controller: read each layout's predicted mean latency at the "
                                          "arrival rate times 1 + this margin (attainment and τ at the rate)")
    # feedback (controller.py): when the current layout realises, over the last `feedback_window_s`
    # since it began serving, attainment below its prediction by more than `feedback_tolerance` (and
    # by more than two binomial standard deviations, over at least `feedback_min_requests`), every
    # layout is priced at the rate at which the current one's prediction matches what it realised
    # (at most `feedback_max_scale` times the arrival rate). 0 requests: off, the default: it rescues
    # `price_answer_ends` on a step 20 -> 90 -> 20 req/s, but on the bursty sped-up code trace it
    # switched 9-10 times where the controller without it switches 3, and lost 3.6-4 points
    # (docs/simulation.md, "Feedback from the layout being served")
    # refinement by replay (controller.py, "Refinement"): the analytic ranking's best
    # `refine_candidates` layouts and the current one are replayed on the last `refine_window_s` of
    # arrivals by a refiner the host supplies (the simulator's own event loop; serve has none), and
    # the decision chooses among them by what the replays realise. A replay is reused for
    # `refine_every_s`; the first `refine_warmup` share of its arrivals fill the empty instances and
    # are not counted. 0: off, the default
    refine_candidates: int = opt(0, "cluster controller: replay the recent arrivals on this many of the best "
                                    "predicted layouts and the current one, and choose among them by the replays "
                                    "(0: off; the simulator only)")
    refine_window_s: float = 15.0
    refine_every_s: float = 10.0
    refine_warmup: float = 1.0 / 3.0
    feedback_window_s: float = 15.0
    # latency feedback (feedback.py): the served layout's realised mean latency (requests that
    # arrived since it began serving, over the feedback window, at least this many finished) over
    # its prediction, smoothed per layout and remembered with the rate it was measured at; a layout's
    # predicted latency is scaled by it while the rate is within the tolerance, for the memory's span
    latency_feedback_requests: int = opt(20, "cluster controller: finished requests of the layout being served "
                                             "before its predicted mean latency is scaled by what it realised "
                                             "(remembered per layout at that load; 0: off)")
    latency_feedback_smoothing: float = 0.3
    # while the current layout keeps up (no backlog predicted), a switch may not lose more predicted
    # attainment than this for a faster or higher-τ layout: on the conversation mix the objective's
    # latency term, off by up to 2x near capacity, took the controller from 2x4 to 1x8 at 9.5 req/s
    # (1.4 points fewer predicted, 91% realised) and, with latency feedback, from 8x1 to
    # 2+1+1+1+1+1+1 at 20 req/s (docs/simulation.md, "Latency feedback")
    switch_attainment_tolerance: float = opt(0.005, "cluster controller: the most predicted SLO attainment (a "
                                                    "fraction) a switch may give up for speed or τ (inf: no limit)")
    latency_memory_rate_tolerance: float = 0.25
    latency_memory_s: float = 300.0
    feedback_min_requests: int = opt(0, "cluster controller: finished or overdue requests needed before its "
                                        "prediction for the current layout is corrected to what that layout "
                                        "realised (0: never; the realised share is recorded either way)")
    feedback_tolerance: float = 0.05
    feedback_max_scale: float = 2.0
    # bursts (controller.py, `spread`): arrivals counted over the window in bins `burst_bin_slos` times
    # the sample's median SLO long; where they vary beyond Poisson noise, each share of the arrivals
    # is priced at the rate of the bins it came in, not all at the window's mean (`bursts.burst_spread`).
    # On the sped-up code trace the mean alone predicted 4x2 25 points above what it realised (with the
    # spread: 12), and auto started on 4+1+1+1+1 (68.6%) where it now starts on and holds 4x2 (70.3%);
    # Poisson, step and diurnal loads are unchanged (docs/simulation.md, "Bursts within the window")
    price_bursts: bool = opt(True, "cluster controller: price arrivals that come in bursts at the rates of their "
                                    "bursts, not at the window's mean rate")
    burst_bin_slos: float = 16.0
    burst_levels: int = 8
    tokens_per_step_smoothing: float = 0.2  # weight of each round's τ -> tokens/step estimate
    bandwidth_gbps: float = opt(100.0, "device-to-device bandwidth (GB/s into each device) the controller assumes "
                                       "for resharding", name="--interconnect-gbps")
    compile_s: float = opt(10.0, "seconds to compile a placement never compiled (the old layout serves meanwhile)")
    load_s: float = opt(1.0, "seconds to build and warm one new instance whose executables are compiled already "
                             "(from memory or the persistent compile cache)")
    tau_weight: float = 0.1
    latency_weight: float = 0.2
    target_utilisation: float = 0.85
    # a late request's latency: it waits for the instance to empty of requests in time, or for its
    # starvation after this many scheduler rounds (0: it runs right behind the requests in time it
    # found, which prices a late request at 1 s where it realises 14-17 s near capacity on a
    # conversation mix). Off by default: it wins steady loads and loses changing ones
    # (docs/simulation.md, "Late requests wait for the requests in time")
    late_wait_rounds: float = opt(0.0, "cluster controller: price a late request as waiting for the requests in "
                                       "time to leave, or for its starvation after this many rounds (the "
                                       f"scheduler's: {LATE_WAIT_ROUNDS:g}); 0: it runs right behind them")
    max_migrations: int = 4  # per round
    migration_cooldown_s: float = 5.0  # a request moves at most once per this long

    def __post_init__(self) -> None:
        if min(self.interval_s, self.window_s, self.horizon_s, self.bandwidth_gbps) <= 0:
            raise ValueError("interval, window, horizon and bandwidth must be positive")
        if min(self.min_dwell_s, self.hysteresis, self.compile_s, self.load_s) < 0 or self.confirmations < 1:
            raise ValueError("dwell, hysteresis, compile and load times must be >= 0, confirmations >= 1")
        if self.settle_tolerance is not None and not self.settle_tolerance >= 0:
            raise ValueError("settle tolerance must be >= 0 (or None: off)")
        if not 0 < self.target_utilisation <= 1 or self.sample_size < 1 or self.max_migrations < 0:
            raise ValueError("target utilisation in (0, 1], sample size >= 1, max migrations >= 0")
        if self.feedback_window_s <= 0 or self.feedback_min_requests < 0 or self.feedback_tolerance < 0 \
                or self.feedback_max_scale < 1:
            raise ValueError("feedback window > 0, min requests >= 0, tolerance >= 0, max scale >= 1")
        if self.refine_candidates < 0 or not 0 < self.refine_window_s or self.refine_every_s < 0 \
                or not 0 <= self.refine_warmup < 1 or (self.refine_candidates and self.refine_window_s > self.window_s):
            raise ValueError("refine candidates >= 0, replay window in (0, the arrival window], replays reused "
                             "for >= 0 s, warm-up share in [0, 1)")
        if not self.switch_attainment_tolerance >= 0:
            raise ValueError("switch attainment tolerance must be >= 0 (inf: no limit)")
        if self.latency_feedback_requests < 0 or not 0 < self.latency_feedback_smoothing <= 1 \
                or self.latency_memory_rate_tolerance < 0 or self.latency_memory_s < 0:
            raise ValueError("latency feedback requests >= 0, smoothing in (0, 1], rate tolerance >= 0, memory >= 0 s")
        if not self.late_wait_rounds >= 0:
            raise ValueError("late wait rounds must be >= 0 (0: off)")
        if not self.latency_rate_margin >= 0:
            raise ValueError("latency rate margin must be >= 0")
        if not 0 < self.tokens_per_step_smoothing <= 1:
            raise ValueError("tokens/step smoothing must be in (0, 1] (1: no smoothing)")

    def value(self, attainment: float, tau: float, latency_s: float, ref_latency_s: float) -> float:
        """The decision's objective (module doc): one place, so the decision, the simulator's start
        layout and the calibration ranking all weigh predictions alike."""
        return attainment + self.tau_weight * tau - self.latency_weight * latency_s / max(ref_latency_s, 1e-9)


@dataclass(frozen=True, slots=True)
class Decision:
    time: float
    current: str
    chosen: str  # == current when staying
    switch: bool
    reason: str
    rate: float  # arrivals per second in the window
    # layout -> (att, lat s, τ): the current layout and the top three candidates, best first
    predicted: Mapping[str, tuple[float, float, float]] = field(default_factory=dict)
    cost: float = 0.0  # objective units
    seconds: float = 0.0  # how long deciding took
    realised: float | None = None  # the current layout's realised attainment when it was checked (feedback)

    def __str__(self) -> str:
        cur = self.predicted.get(self.current)
        new = self.predicted.get(self.chosen)
        fmt = lambda p: f"{p[0]:.1%} att, {p[1] * 1e3:.0f} ms, τ {p[2]:.2f}" if p else "n/a"  # noqa: E731
        what = f"switch {self.current} -> {self.chosen}" if self.switch else f"stay on {self.current}"
        others = [f"{k} {v[0]:.1%}" for k, v in self.predicted.items() if k not in (self.current, self.chosen)]
        runners_up = f"; then {', '.join(others)}" if others else ""
        got = "" if self.realised is None else f", realised {self.realised:.1%}"
        return (f"{what} at {self.rate:.2f} req/s: {self.reason} (now {fmt(cur)}{got}; best {fmt(new)}{runners_up})")


@dataclass(frozen=True, slots=True)
class Migration:
    request_id: str
    source: str
    target: str
    reason: str


@dataclass(frozen=True, slots=True)
class AtRisk:
    """A request an instance reports as at risk (in its published snapshot)."""

    request_id: str
    deadline: float
    remaining_s: float  # its predicted time to finish there at its τ floor, if it ran now
    running: bool
    moves: int
    last_move: float | None
