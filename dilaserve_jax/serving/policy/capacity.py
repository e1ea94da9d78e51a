"""What a layout of instances would deliver at a given load: SLO attainment, latency and τ.

The controller asks this for every candidate layout, so it is built to be cheap (pure Python +
numpy; no JAX):

1. Per TP degree, once per decision, `instance_curves` tabulates one instance's steady state over a
   grid of arrival rates λ: the batch it settles at (Little's law, b = λ · T(b)), the system τ its
   load control holds (the highest τ whose capacity keeps utilisation under a target), the
   queueing wait (M/M/c with c = slots, Erlang C), and, for a sample of recent requests, each one's
   τ (the highest under the system cap that meets its deadline) and whether it meets its deadline.
   Request times come from the latency model (refresh and reuse steps costed separately, per TP
   degree) and the τ -> tokens/step estimate.
2. `evaluate_layouts` splits the load over the instances of each candidate as the router does (it
   sends each request to the earliest predicted finish, so in steady state instances run at equal
   latency: water-filling on the latency curves) and reads off attainment, mean latency and mean
   τ — vectorised over all candidates at once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from dilaserve_jax.serving.policy.latency import LatencyModel
from dilaserve_jax.core.kinds import StepKind

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


def service_times(latency: LatencyModel, tp: int, sample: Sequence[RequestShape], slots: int,
                  taus: np.ndarray, rates: np.ndarray) -> np.ndarray:
    """Seconds to serve each sampled request among b concurrent ones, at each τ: [b = 1..slots, τ, request]
    (each round one batch of b, or its cheapest split where the measured profile says so)."""
    canvas = np.array([r.canvas for r in sample], dtype=np.float64)
    block = np.array([r.block_len for r in sample], dtype=np.float64)
    blocks = np.array([r.answer_len // r.block_len for r in sample], dtype=np.float64)
    b = np.arange(1, slots + 1, dtype=np.float64)[:, None]
    t_ref = latency.round_many(StepKind.REFRESH, b, canvas[None, :], block[None, :], tp)  # [B, J]
    t_reu = latency.round_many(StepKind.REUSE, b, canvas[None, :], block[None, :], tp)
    per_block = np.maximum(1.0, np.ceil(block[None, :] / np.maximum(1.0, rates[:, None])))  # [T, J]
    n_ref = np.broadcast_to(blocks[None, :], per_block.shape)
    n_reu = blocks[None, :] * per_block - n_ref
    return n_ref[None] * t_ref[:, None, :] + n_reu[None] * t_reu[:, None, :]


def _erlang_c(servers: int, offered: np.ndarray) -> np.ndarray:
    """P(wait > 0) in M/M/c with c = servers and offered load a = λ·T (vectorised over a < c)."""
    a = np.asarray(offered, dtype=np.float64)
    # Erlang B by its recursion (stable), then C = B / (1 - ρ (1 - B))
    blocking = np.ones_like(a)
    for k in range(1, servers + 1):
        blocking = a * blocking / (k + a * blocking)
    rho = a / servers
    return np.clip(blocking / np.maximum(1e-12, 1.0 - rho * (1.0 - blocking)), 0.0, 1.0)


def instance_curves(latency: LatencyModel, tp: int, sample: Sequence[RequestShape], slots: int,
                    taus: Sequence[float], tokens_per_step: Sequence[float], *, tau_floor: float,
                    target_utilisation: float = 0.85) -> Curves:
    """Tabulate one TP-`tp` instance over arrival rates up to twice its capacity (see module doc)."""
    if not sample:
        raise ValueError("need at least one sampled request")
    taus_arr = np.asarray(taus, dtype=np.float64)  # descending
    rates_arr = np.asarray(tokens_per_step, dtype=np.float64)
    times = service_times(latency, tp, sample, slots, taus_arr, rates_arr)  # [B, T, J]
    mean_t = times.mean(axis=2)  # [B, T]
    tau_min = np.array([r.tau_min for r in sample])
    tau_max = np.array([r.tau_max for r in sample])
    slo = np.array([r.slo_s for r in sample])
    allowed = taus_arr >= tau_floor - 1e-9
    lowest = int(np.flatnonzero(allowed)[-1]) if allowed.any() else len(taus_arr) - 1
    capacity = slots / mean_t[slots - 1, lowest]
    rates = np.concatenate([[0.0], np.geomspace(capacity / 200, 2 * capacity, RATE_POINTS - 1)])

    # system τ: the highest allowed τ whose full-batch capacity keeps utilisation under the target
    util = rates[:, None] * mean_t[slots - 1][None, :] / slots  # [R, T]
    ok = (util <= target_utilisation) & allowed[None, :]
    sys_idx = np.where(ok.any(axis=1), ok.argmax(axis=1), lowest)  # first (highest) τ that is ok
    t_sys = mean_t[:, sys_idx].T  # [R, B] per-request time at the system τ, by batch
    batch = np.ones(len(rates))
    for _ in range(12):  # Little's law fixed point, b in [1, slots]
        idx = np.clip(np.round(batch).astype(int) - 1, 0, slots - 1)
        batch = np.clip(rates * t_sys[np.arange(len(rates)), idx], 1.0, slots)
    b_idx = np.clip(np.round(batch).astype(int) - 1, 0, slots - 1)
    t_full = mean_t[slots - 1, sys_idx]
    rho = rates * t_full / slots
    under = rho < 1.0
    c_wait = np.where(under, _erlang_c(slots, np.minimum(rates * t_full, slots * 0.999)), 1.0)
    decay = np.where(under, slots * (1.0 - rho) / t_full, 0.0)  # P(W > x) = C exp(-decay x)
    mean_wait = np.where(under, c_wait / np.maximum(decay, 1e-12), np.inf)

    # each sampled request's τ: the highest in its range, under the system cap, that meets its
    # deadline at the mean wait; else the lowest of its range. Attainment: P(wait <= slo - own time)
    own = times[b_idx]  # [R, T, J]
    low = np.minimum(np.maximum(tau_min, tau_floor), tau_max)  # [J] its effective floor
    allowed_j = (taus_arr[:, None] <= tau_max[None, :] + 1e-9) & (taus_arr[:, None] >= low[None, :] - 1e-9)  # [T, J]
    floor_idx = len(taus_arr) - 1 - np.argmax(allowed_j[::-1, :], axis=0)  # [J] lowest allowed τ
    capped = allowed_j[None, :, :] & (taus_arr[None, :, None] <= taus_arr[sys_idx][:, None, None] + 1e-9)
    wait = np.where(np.isfinite(mean_wait), mean_wait, 0.0)[:, None, None]
    fits = capped & (own + wait <= slo[None, None, :])
    chosen = np.where(fits.any(axis=1), fits.argmax(axis=1), floor_idx[None, :])  # [R, J]
    own_t = np.take_along_axis(own, chosen[:, None, :], axis=1)[:, 0, :]  # [R, J]
    slack = slo[None, :] - own_t
    p_meet = np.where(slack < 0, 0.0, 1.0 - c_wait[:, None] * np.exp(-decay[:, None] * np.maximum(slack, 0.0)))
    served = np.where(under, 1.0, 1.0 / np.maximum(rho, 1e-12))  # overloaded: the excess never finishes in time
    attainment = np.where(under, p_meet.mean(axis=1), served * p_meet.mean(axis=1))
    latency_s = own_t.mean(axis=1) + np.where(np.isfinite(mean_wait), mean_wait, 0.0)
    latency_s = np.where(under, latency_s, latency_s + 10.0 * t_full * (rho - 1.0) * slots)
    return Curves(tp, rates, np.clip(attainment, 0.0, 1.0), latency_s, taus_arr[chosen].mean(axis=1), capacity)


@dataclass(frozen=True, slots=True)
class LayoutPrediction:
    layout: tuple[int, ...]
    attainment: float
    latency_s: float
    tau: float


def evaluate_layouts(layouts: Sequence[tuple[int, ...]], curves: Mapping[int, Curves], rate: float
                     ) -> list[LayoutPrediction]:
    """Predicted attainment, mean latency and mean τ of each layout (a tuple of TP degrees) at
    `rate` req/s, with the load split as the router splits it (equal latency; see module doc)."""
    tps = sorted(curves)
    counts = np.array([[lay.count(t) for t in tps] for lay in layouts], dtype=np.float64)  # [C, K]
    if rate <= 0:
        zero = [curves[t] for t in tps]
        lat0 = np.array([c.latency[0] for c in zero])
        best = np.where(counts > 0, lat0[None, :], np.inf).argmin(axis=1)
        return [LayoutPrediction(lay, float(zero[k].attainment[0]), float(zero[k].latency[0]), float(zero[k].tau[0]))
                for lay, k in zip(layouts, best)]
    lat_all = np.concatenate([curves[t].latency[np.isfinite(curves[t].latency)] for t in tps])
    levels = np.unique(np.clip(np.concatenate([lat_all, np.geomspace(lat_all.min(), lat_all.max(), 64)]),
                               lat_all.min(), lat_all.max()))
    # rate one instance of each TP takes at each latency level: the inverse of its latency curve
    take = np.stack([_inverse(curves[t], levels) for t in tps])  # [K, G]
    total = counts @ take  # [C, G]
    reach = total >= rate
    idx = np.where(reach.any(axis=1), reach.argmax(axis=1), len(levels) - 1)
    lo = np.maximum(idx - 1, 0)
    span = total[np.arange(len(layouts)), idx] - total[np.arange(len(layouts)), lo]
    frac = np.where(span > 0, (rate - total[np.arange(len(layouts)), lo]) / np.where(span > 0, span, 1.0), 1.0)
    frac = np.clip(frac, 0.0, 1.0)
    per = take[:, lo].T + frac[:, None] * (take[:, idx].T - take[:, lo].T)  # [C, K] rate per instance
    overloaded = ~reach.any(axis=1)
    if overloaded.any():  # beyond every latency level: split in proportion to capacity
        cap = np.array([curves[t].capacity for t in tps])
        share = counts[overloaded] * cap[None, :]
        per[overloaded] = rate * cap[None, :] / share.sum(axis=1, keepdims=True)
    # each layout's rate-weighted mean over its instances, TP by TP (all layouts at once; the same
    # arithmetic, in the same order, as summing per layout)
    att, lat, tau = (np.zeros(len(layouts)) for _ in range(3))
    for k, t in enumerate(tps):
        used = counts[:, k] != 0
        if not used.any():
            continue
        r = per[:, k]
        cv = curves[t]
        w = counts[:, k] * r / rate
        att = np.where(used, att + w * np.interp(r, cv.rates, cv.attainment), att)
        lat = np.where(used, lat + w * np.interp(r, cv.rates, cv.latency), lat)
        tau = np.where(used, tau + w * np.interp(r, cv.rates, cv.tau), tau)
    return [LayoutPrediction(lay, float(a), float(l), float(u)) for lay, a, l, u in zip(layouts, att, lat, tau)]


def _inverse(cv: Curves, levels: np.ndarray) -> np.ndarray:
    """Highest arrival rate at which the instance's latency stays <= each level (0 if none)."""
    lat = np.maximum.accumulate(np.where(np.isfinite(cv.latency), cv.latency, np.inf))
    finite = np.isfinite(lat)
    if not finite.any():
        return np.zeros_like(levels)
    lat, rates = lat[finite], cv.rates[finite]
    out = np.interp(levels, lat, rates, left=0.0, right=rates[-1])
    return np.where(levels < lat[0], 0.0, out)
