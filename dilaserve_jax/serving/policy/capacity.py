"""What a layout of instances would deliver at a given load: SLO attainment, latency and τ.

The controller asks this for every candidate layout, so it is built to be cheap (pure Python +
numpy; no JAX):

1. Per TP degree, once per decision, `instance_curves` tabulates one instance's steady state over a
   grid of arrival rates λ as a birth-death chain on the requests in time it holds: with n there,
   min(n, slots) run and finish at the rate their service times at that batch give; an arrival
   takes the highest τ in its range that meets its deadline after the departures ahead of it, or
   misses (it runs late, at its floor, behind the others). Service times come from the latency
   model (refresh and reuse steps apart, per TP degree, each round priced as the decoder runs a
   batch of the sampled shapes: one padded step per length bucket present, `round_times`; a
   refresh at the mean price of the groups refreshes run in, b of them per turn) and the
   τ -> tokens/step estimate.
2. `layout_eval.evaluate_layouts` combines those curves into each candidate layout's figures.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from dilaserve_jax.core.buckets import padded
from dilaserve_jax.core.kinds import StepKind
from dilaserve_jax.serving.policy.latency import LatencyModel

RATE_POINTS = 48


@dataclass(frozen=True, slots=True)
class RequestShape:
    """What the controller keeps of an arrival: lengths, SLO and τ range."""

    prompt_len: int
    answer_len: int
    block_len: int
    slo_s: float
    tau_min: float = 0.5
    tau_max: float = 1.0

    @property
    def canvas(self) -> int:
        return self.prompt_len + self.answer_len


@dataclass(frozen=True, slots=True)
class Curves:
    """One instance of a TP degree, tabulated over arrival rates (req/s)."""

    tp: int
    rates: np.ndarray  # [R] ascending, rates[0] = 0
    attainment: np.ndarray  # [R] fraction of requests meeting their deadline
    latency: np.ndarray  # [R] mean seconds from arrival to finish
    tau: np.ndarray  # [R] mean τ
    capacity: float  # req/s at full batch and the lowest τ allowed
    taus: np.ndarray | None = None  # [T] descending: the τ grid of `capacity_by_tau`
    capacity_by_tau: np.ndarray | None = None  # [T] req/s at full batch, everyone at that τ
    pressed: bool = False  # a loaded instance runs everyone at the floor (arrival pressure)


@dataclass(frozen=True, slots=True)
class StepShapes:
    """How the decoder runs one step over a batch, so a round is priced as it runs: one compiled
    step per (length bucket, block) group present, each group's batch padded up to a batch
    bucket; without length buckets, one step over the whole batch at its longest canvas."""

    length_buckets: tuple[int, ...] = ()
    batch_buckets: tuple[int, ...] = ()
    draws: int = 32  # random batch compositions averaged per batch size (fixed seed: deterministic)


def round_times(latency: LatencyModel, kind: StepKind, tp: int, sample: Sequence[RequestShape], slots: int,
                shapes: StepShapes | None = None) -> np.ndarray:
    """Seconds of the round that gives each sampled request one step while b requests share the
    instance, the other b - 1 drawn from the sample: [b = 1..slots, request]. With `shapes`, the
    round is the sum of its groups' steps; without, one batch of b at the request's own canvas."""
    canvas = np.array([r.canvas for r in sample], dtype=np.int64)
    block = np.array([r.block_len for r in sample], dtype=np.int64)
    b = np.arange(1, slots + 1)
    if shapes is None:
        return latency.round_many(kind, b[:, None], canvas[None, :], block[None, :], tp)
    pad_b = np.array([padded(int(n), shapes.batch_buckets) for n in range(slots + 1)])
    rng = np.random.default_rng(0)
    out = np.empty((slots, len(sample)))
    if shapes.length_buckets:
        keys = [(padded(int(c), shapes.length_buckets), int(k)) for c, k in zip(canvas, block)]
        groups = sorted(set(keys))
        g_of = np.array([groups.index(k) for k in keys])
        # table[g, n]: one step of n requests of group g (n = 0: no step)
        lens = np.array([g[0] for g in groups])[:, None]
        blks = np.array([g[1] for g in groups])[:, None]
        table = np.zeros((len(groups), slots + 1))
        table[:, 1:] = latency.round_many(kind, pad_b[None, 1:], lens, blks, tp)
        for i, n in enumerate(b):
            others = rng.integers(len(sample), size=(shapes.draws, n - 1))
            counts = np.zeros((shapes.draws, len(groups)), dtype=np.int64)
            np.add.at(counts, (np.arange(shapes.draws)[:, None], g_of[others]), 1)
            base = np.take_along_axis(table[None, :, :], counts[:, :, None], axis=2)[:, :, 0].sum(axis=1)  # [R]
            own = counts[:, g_of]  # [R, J] others in each request's own group
            t = base[:, None] - table[g_of[None, :], own] + table[g_of[None, :], own + 1]
            out[i] = t.mean(axis=0)
        return out
    # one step at the longest canvas of the batch (and its block)
    table = latency.round_many(kind, pad_b[1:, None], canvas[None, :], block[None, :], tp)  # [B, J]
    for i, n in enumerate(b):
        others = rng.integers(len(sample), size=(shapes.draws, n - 1))
        longest = others[np.arange(shapes.draws), canvas[others].argmax(axis=1)] if n > 1 else None
        idx = np.broadcast_to(np.arange(len(sample)), (shapes.draws, len(sample)))
        if longest is not None:
            idx = np.where(canvas[None, :] >= canvas[longest][:, None], idx, longest[:, None])
        out[i] = table[i][idx].mean(axis=0)
    return out


def service_times(latency: LatencyModel, tp: int, sample: Sequence[RequestShape], slots: int,
                  taus: np.ndarray, rates: np.ndarray, shapes: StepShapes | None = None,
                  last_block_fill: float = 1.0) -> np.ndarray:
    """Seconds to serve each sampled request among b concurrent ones, at each τ: [b = 1..slots, τ, request]
    (each round priced by `round_times`). `last_block_fill`: the share of its last block a request
    decodes before its answer ends (`answer_fill.py`; 1: every position of the area)."""
    return _served(*_round_prices(latency, tp, sample, slots, shapes), sample, rates, last_block_fill)


def _round_prices(latency: LatencyModel, tp: int, sample: Sequence[RequestShape], slots: int,
                  shapes: StepShapes | None) -> tuple[np.ndarray, np.ndarray]:
    """(a refresh's price, a reuse round's), [b = 1..slots, request]."""
    t_ref = round_times(latency, StepKind.REFRESH, tp, sample, slots, shapes)  # [B, J]
    # requests reach their refreshes at different steps, so a refresh round takes the g of the b
    # present that need one (g about uniform over 1..b, each round padded), and a request lives
    # through the others' refresh rounds too: b refreshes' worth at the mean price per refresh,
    # b · mean_g≤b t(g) / g = Σ_g≤b t(g) / g
    t_ref = np.cumsum(t_ref / np.arange(1, slots + 1)[:, None], axis=0)
    return t_ref, round_times(latency, StepKind.REUSE, tp, sample, slots, shapes)


def _served(t_ref: np.ndarray, t_reu: np.ndarray, sample: Sequence[RequestShape], rates: np.ndarray,
            last_block_fill: float) -> np.ndarray:
    block = np.array([r.block_len for r in sample], dtype=np.float64)
    blocks = np.array([r.answer_len // r.block_len for r in sample], dtype=np.float64)
    rate = np.maximum(1.0, rates[:, None])
    per_block = np.maximum(1.0, np.ceil(block[None, :] / rate))  # [T, J]
    last = np.maximum(1.0, np.ceil(np.maximum(1.0, last_block_fill * block[None, :]) / rate))  # the last block's steps
    n_ref = np.broadcast_to(blocks[None, :], per_block.shape)
    n_reu = (blocks[None, :] - 1.0) * per_block + last - n_ref
    return n_ref[None] * t_ref[:, None, :] + n_reu[None] * t_reu[:, None, :]


def instance_curves(latency: LatencyModel, tp: int, sample: Sequence[RequestShape], slots: int,
                    taus: Sequence[float], tokens_per_step: Sequence[float], *, tau_floor: float,
                    target_utilisation: float = 0.85, shapes: StepShapes | None = None,
                    max_states: int = 1024, pressure_share: float | None = None,
                    late_riders: int = 1, last_block_fill: float = 1.0,
                    late_wait_rounds: float | None = None) -> Curves:
    """Tabulate one TP-`tp` instance over arrival rates up to twice its capacity (see module doc).

    The instance is a birth-death chain on the requests in time it holds (n): with n present,
    b = min(n, slots) run, and they finish at rate b / (their mean service time at batch b). An
    arrival that finds n picks, as the threshold controller does, the highest τ in its range that
    meets its deadline after the n - slots + 1 departures ahead of it (at full batch and that τ)
    plus its own time at batch min(n + 1, slots); one that cannot meet it even at its floor is a
    miss and does not join: it runs at its floor on spare capacity, behind the requests in time
    (a late request waits unplanned). Attainment, latency and τ are the arrival-weighted means
    over the chain's stationary distribution at each rate. `target_utilisation` is unused (the
    chain finds where τ must drop).

    `pressure_share`: the instances' arrival-pressure rule (`ThresholdConfig.pressure_at_risk_share`):
    where the chain misses at least that share of the arrivals, requests run at their floor (the
    budget's) for part of the time, which sets τ (a mix of the chain and a second chain in which each
    arrival takes its floor whatever its deadline allows); attainment and latency are the second
    chain's there, ramped in below the share (see the comment below).

    `late_riders`: late requests running in the steps of the requests in time while any are there
    (0: the misses cost the requests in time nothing, as before; see the comment in `solve`).

    `last_block_fill`: the share of its last block a request decodes before its answer ends
    (`service_times`).

    `late_wait_rounds`: the scheduler rounds a late request waits at most before it goes first
    (starvation: `SchedulerConfig.max_skip / at_risk_skip_share`). With it, a late request waits
    until the requests in time have all left (the chain's first passage to an empty instance from
    the state it found) or it starves, whichever comes first, then runs; None: it runs right behind
    the requests in time it found (the latency of late requests 10-20x short where many miss)."""
    if not sample:
        raise ValueError("need at least one sampled request")
    taus_arr = np.asarray(taus, dtype=np.float64)  # descending
    rates_arr = np.asarray(tokens_per_step, dtype=np.float64)
    prices = _round_prices(latency, tp, sample, slots, shapes)
    times = _served(*prices, sample, rates_arr, last_block_fill)  # [B, T, J]
    mean_t = times.mean(axis=2)  # [B, T]
    # the instances' planner prices a request at its whole answer area (it cannot know where the
    # answer ends), so it chooses τ and finds a request at risk by those times; the steps it then
    # runs are the shorter ones
    plan = (_served(*prices, sample, rates_arr, 1.0) if last_block_fill < 1.0 else times)
    tau_min = np.array([r.tau_min for r in sample])
    tau_max = np.array([r.tau_max for r in sample])
    slo = np.array([r.slo_s for r in sample])
    allowed = taus_arr >= tau_floor - 1e-9
    lowest = int(np.flatnonzero(allowed)[-1]) if allowed.any() else len(taus_arr) - 1
    capacity = slots / mean_t[slots - 1, lowest]
    starve_s = None
    if late_wait_rounds is not None:  # those rounds at a full batch, everyone at the floor
        unit = np.ones((1, len(sample)))  # `_served` at one second a step counts each request's steps
        steps = _served(unit, unit, sample, rates_arr[lowest:lowest + 1], 1.0)[0, 0]
        starve_s = late_wait_rounds * float(np.mean(times[slots - 1, lowest] / steps))
    rates = np.concatenate([[0.0], np.geomspace(capacity / 200, 2 * capacity, RATE_POINTS - 1)])

    low = np.minimum(np.maximum(tau_min, tau_floor), tau_max)  # [J] each request's effective floor
    allowed_j = (taus_arr[:, None] <= tau_max[None, :] + 1e-9) & (taus_arr[:, None] >= low[None, :] - 1e-9)  # [T, J]
    floor_idx = len(taus_arr) - 1 - np.argmax(allowed_j[::-1, :], axis=0)  # [J] lowest allowed τ
    # states an arrival can find: up to where even the fastest drain leaves no SLO in reach
    per_departure = mean_t[slots - 1, lowest] / slots
    depth = int(np.clip(np.ceil(slo.max() / max(per_departure, 1e-12)), 1, max_states - slots))
    # with late riders each batch carries k more (full batches stay full): built once, for both chains
    k = min(late_riders, slots)
    heavier = (lambda a: np.concatenate([a[k:], np.repeat(a[-1:], k, axis=0)])) if k else None
    loaded_times, loaded_mean = (heavier(times), heavier(mean_t)) if k else (None, None)
    loaded_plan = (loaded_times if plan is times else heavier(plan)) if k else None

    def solve(allowed: np.ndarray):
        plain = _Chain(times, mean_t, allowed, floor_idx, slo, taus_arr, slots, depth, lowest, plan, starve_s)
        att, lat, tau, batch, late_t = plain.solve(rates)
        if not k:
            return att, lat, tau
        # late work is not free: under the overload rules a late request rides in the steps of the
        # requests in time (a starved one always, others when cheap), so for the share of time one
        # is running each of their steps carries `late_riders` more requests. That share: the
        # misses' arrival rate times a late request's own time at the batch the chain runs
        # (Little's law), at most all of the time (a late backlog that grows). Without this the
        # chain was up to 35 points optimistic where many requests miss even on an idle instance
        # (SLOs tight for the TP degree: a TP-1 instance under SLOs set by a TP-8 one)
        loaded = _Chain(loaded_times, loaded_mean, allowed, floor_idx, slo, taus_arr, slots, depth, lowest,
                        loaded_plan, starve_s).solve(rates)
        share = np.clip(rates * (1.0 - att) * late_t / k, 0.0, 1.0)
        return tuple(share * h + (1.0 - share) * p for h, p in zip(loaded[:3], (att, lat, tau)))
    attainment, latency_s, tau_mean = solve(allowed_j)
    if pressure_share is not None:
        at_floor = allowed_j & (np.arange(len(taus_arr))[:, None] == floor_idx[None, :])
        pressed = solve(at_floor)
        # at every rate where the plain chain misses the share: with the overload rules late
        # requests take one slot and cheap rides only, so past the capacity too the requests in time
        # are served as the pressed chain has them (with the rules off the late backlog took over
        # half the rows, and this stopped at the capacity at the floor). The rule is a feedback
        # loop, on while the last window's at-risk share reaches the share and off below, so an
        # instance the floor more than rescues settles where it misses about that share, pressed for
        # the part f of the time that gives it; pressed outright, the prediction jumped at the share
        # and a layout missing a little more looked better than one missing a little less (the
        # controller switched 1x8 <-> 2x4 at 30 req/s)
        on = 1.0 - attainment >= pressure_share
        target = 1.0 - pressure_share
        lift = pressed[0] - attainment
        f = np.clip((target - attainment) / np.where(lift > 1e-9, lift, 1.0), 0.0, 1.0)
        f = np.where(lift > 1e-9, f, 1.0)
        # ...but that part f sets only the τ the instance runs at. A request is found at risk when it
        # is planned, long before it would finish late, and finding it so turns the rule on, so the
        # pressed instance serves most of the requests that set it off in time: deadlines and
        # latency are the pressed chain's wherever the plain one misses the share, ramped in from
        # no misses (the mix settled every loaded layout at 1 - share, ~95%, where the simulator
        # measures 97-100%: conversation mix at 9.5 req/s, code trace at 30)
        ramp = np.clip((1.0 - attainment) / max(pressure_share, 1e-9), 0.0, 1.0)
        tau_mean = np.where(on, f * pressed[2] + (1.0 - f) * tau_mean, tau_mean)
        attainment, latency_s = (n + ramp * (p - n) for p, n in zip(pressed, (attainment, latency_s)))
    return Curves(tp, rates, np.clip(attainment, 0.0, 1.0), latency_s, tau_mean, capacity, taus_arr,
                  slots / mean_t[slots - 1], pressed=pressure_share is not None)


class _Chain:
    """The birth-death chain of `instance_curves`, over the requests in time an arrival finds."""

    def __init__(self, times, mean_t, allowed_j, floor_idx, slo, taus, slots: int, depth: int, lowest: int,
                 plan=None, starve_s: float | None = None):
        """`times` [B, T, J]: what serving takes (`mean_t`: its mean over J); `plan`: what the planner
        prices it at (None: the same); `starve_s`: the longest a late request waits (None: it does
        not wait for the requests in time, see `instance_curves`)."""
        self.starve_s = starve_s
        self.times, self.mean_t, self.allowed_j, self.floor_idx = times, mean_t, allowed_j, floor_idx
        self.plan = times if plan is None else plan
        self.slo, self.taus, self.slots, self.lowest = slo, taus, slots, lowest
        self.n = np.arange(slots + depth)

    def solve(self, rates: np.ndarray):
        """Per arrival rate: attainment, mean latency (s), mean τ, the mean batch the requests in
        time run at, and a late request's own time at that batch (for `late_riders`)."""
        n, slots, times, mean_t = self.n, self.slots, self.times, self.mean_t
        batch_idx = np.minimum(n + 1, slots) - 1  # the batch an arrival joins
        ahead = np.maximum(0, n + 1 - slots)  # departures to wait for
        wait = ahead[:, None] * mean_t[slots - 1][None, :] / slots  # [N, T] at that τ for everyone
        own = times[batch_idx]  # [N, T, J]
        # the τ it gets and whether it is at risk: by the planner's prices
        plan = self.plan
        plan_wait = wait if plan is times else ahead[:, None] * plan[slots - 1].mean(axis=1)[None, :] / slots
        fits = self.allowed_j[None] & (plan_wait[:, :, None] + plan[batch_idx] <= self.slo[None, None, :])
        met = fits.any(axis=1)  # [N, J]
        chosen = np.where(met, fits.argmax(axis=1), self.floor_idx[None, :])  # [N, J] highest τ that fits
        own_t = np.take_along_axis(own, chosen[:, None, :], axis=1)[:, 0, :]  # [N, J]
        wait_t = np.take_along_axis(wait, chosen, axis=1)
        join = met.mean(axis=1)  # [N] share of arrivals in state n that join
        # departure rate with n + 1 present (at the arrivals' own τ choices)
        joined = np.maximum(met.sum(axis=1), 1)
        serve_t = np.where(met.any(axis=1), np.where(met, own_t, 0.0).sum(axis=1) / joined, own_t.mean(axis=1))
        mu = np.minimum(n + 1, slots) / np.maximum(serve_t, 1e-12)  # those in service / their time
        with np.errstate(divide="ignore"):
            steps = np.log(join) - np.log(mu)
            log_rate = np.log(np.maximum(rates, 1e-300))
        prefix = np.concatenate([[0.0], np.cumsum(steps)])[: len(n)]
        logp = n[None, :] * log_rate[:, None] + prefix[None, :]  # log p_n = n log λ + Σ_k<n log(join_k / mu_k)
        logp[rates <= 0, 1:] = -np.inf  # no arrivals: empty
        logp -= logp.max(axis=1, keepdims=True)
        p = np.exp(logp)
        p /= p.sum(axis=1, keepdims=True)  # [R, N]
        own_late = times[batch_idx][:, self.floor_idx, np.arange(len(self.slo))]  # [N, J] a miss at its floor
        if self.starve_s is None:  # a miss runs behind the requests in time found with it
            late = wait[:, self.lowest][:, None] + own_late
            latency = p @ np.where(met, wait_t + own_t, late).mean(axis=1)
        else:  # it waits until the instance has emptied of requests in time, or it starves
            in_time = np.where(met, wait_t + own_t, 0.0).mean(axis=1)  # [N]
            late = np.where(met, 0.0, own_late).mean(axis=1)  # [N]
            waited = np.minimum(self._to_empty(p, rates, join), self.starve_s)  # [R, N]
            latency = (p * (in_time + late + (1.0 - join)[None, :] * waited)).sum(axis=1)
        # a late request's own time (at its floor, at the batch the chain runs), over the misses
        batch = p @ np.minimum(n + 1, slots)  # [R]
        missed = p @ (~met).astype(np.float64)  # [R, J]
        own_floor = times[:, self.floor_idx, np.arange(len(self.slo))]  # [B, J]
        at_b = own_floor[np.clip(np.rint(batch).astype(np.int64), 1, slots) - 1]  # [R, J]
        weight = missed.sum(axis=1)
        late_t = np.where(weight > 1e-12, (missed * at_b).sum(axis=1) / np.maximum(weight, 1e-12), at_b.mean(axis=1))
        return p @ join, latency, p @ self.taus[chosen].mean(axis=1), batch, late_t

    @staticmethod
    def _to_empty(p: np.ndarray, rates: np.ndarray, join: np.ndarray) -> np.ndarray:
        """[R, N]: mean time from n requests in time to none. The chain crosses down from k to k - 1
        as often as up, at λ·join[k-1]·p[k-1] per second, and spends P(n >= k) of its time above, so
        one passage down takes P(n >= k) / (λ·join[k-1]·p[k-1]); from n: the sum over k <= n."""
        above = np.cumsum(p[:, ::-1], axis=1)[:, ::-1]  # P(n >= k)
        flux = rates[:, None] * join[None, :-1] * p[:, :-1]  # [R, N - 1] crossings of (k - 1, k), k = 1..
        with np.errstate(divide="ignore", invalid="ignore"):
            down = np.where(flux > 1e-300, above[:, 1:] / flux, np.inf)
        return np.concatenate([np.zeros((len(p), 1)), np.cumsum(down, axis=1)], axis=1)


def with_latency_of(curves: Curves, other: Curves) -> Curves:
    """`curves` with the mean latency `other` predicts at the same rates (`other` tabulates its own
    rate grid; past its last point its last value holds)."""
    return dataclasses.replace(curves, latency=np.interp(curves.rates, other.rates, other.latency))
