"""Each candidate layout's SLO attainment, mean latency and mean τ at a load, from the per-TP
curves `capacity.instance_curves` tabulates.

`evaluate_layouts` splits the load over the instances of each candidate as the router does (it
sends each request to the earliest predicted finish, so in steady state instances run at equal
latency: water-filling on the latency curves) and reads off attainment, mean latency and mean τ,
vectorised over all candidates at once. Past the end of an instance's table (twice its capacity)
the requests in time are served no faster, so attainment falls as 1 / λ.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from dilaserve_jax.serving.policy.capacity import Curves


@dataclass(frozen=True, slots=True)
class LayoutPrediction:
    layout: tuple[int, ...]
    attainment: float
    latency_s: float
    tau: float
    backlog_s: float = 0.0  # of latency_s: the backlog term past the layout's capacity (`_overload`)


OVERLOAD_HORIZON_S = 30.0


def evaluate_layouts(layouts: Sequence[tuple[int, ...]], curves: Mapping[int, Curves], rate: float,
                     overload_horizon_s: float | None = OVERLOAD_HORIZON_S,
                     spread: Sequence[tuple[float, float]] | None = None) -> list[LayoutPrediction]:
    """Predicted attainment, mean latency and mean τ of each layout (a tuple of TP degrees) at
    `rate` req/s, with the load split as the router splits it (equal latency; see module doc).

    `spread`: (multiple of `rate`, share of the arrivals) pairs when the arrivals come in bursts
    (`burst_spread`): each share is priced at its own rate and the figures are their
    arrival-weighted means; the backlog term of an overload is priced at `rate` (a burst's own
    backlog is in the chain's figures at the burst's rate)."""
    tps = sorted(curves)
    counts = np.array([[lay.count(t) for t in tps] for lay in layouts], dtype=np.float64)  # [C, K]
    if rate <= 0:
        zero = [curves[t] for t in tps]
        lat0 = np.array([c.latency[0] for c in zero])
        best = np.where(counts > 0, lat0[None, :], np.inf).argmin(axis=1)
        return [LayoutPrediction(lay, float(zero[k].attainment[0]), float(zero[k].latency[0]), float(zero[k].tau[0]))
                for lay, k in zip(layouts, best)]
    cvs = [curves[t] for t in tps]
    lat_all = np.concatenate([cv.latency[np.isfinite(cv.latency)] for cv in cvs])
    levels = np.unique(np.clip(np.concatenate([lat_all, np.geomspace(lat_all.min(), lat_all.max(), 64)]),
                               lat_all.min(), lat_all.max()))
    # rate one instance of each TP takes at each latency level: the inverse of its latency curve
    take = np.stack([_inverse(cv, levels) for cv in cvs])  # [K, G]
    shares = [(1.0, 1.0)] if not spread else spread
    att, lat, tau = (np.zeros(len(layouts)) for _ in range(3))
    total = sum(w for _, w in shares)
    for mult, weight in shares:
        a, l, u = _at_rate(counts, cvs, take, rate * max(mult, 1e-3))
        att, lat, tau = att + weight / total * a, lat + weight / total * l, tau + weight / total * u
    backlog = _overload(counts, cvs, rate, overload_horizon_s, tau) if overload_horizon_s else np.zeros(len(layouts))
    return [LayoutPrediction(lay, float(a), float(l + b), float(u), float(b))
            for lay, a, l, u, b in zip(layouts, att, lat, tau, backlog)]


def _at_rate(counts: np.ndarray, curves: Sequence[Curves], take: np.ndarray,
             rate: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each layout's (attainment, mean latency, mean τ) at a steady `rate` > 0, before the
    overload's backlog term (`counts` [C, K]: instances of each TP; `take` [K, G]: the rate one
    instance takes at each latency level)."""
    n = len(counts)
    total = counts @ take  # [C, G]
    reach = total >= rate
    idx = np.where(reach.any(axis=1), reach.argmax(axis=1), take.shape[1] - 1)
    lo = np.maximum(idx - 1, 0)
    span = total[np.arange(n), idx] - total[np.arange(n), lo]
    frac = np.where(span > 0, (rate - total[np.arange(n), lo]) / np.where(span > 0, span, 1.0), 1.0)
    frac = np.clip(frac, 0.0, 1.0)
    per = take[:, lo].T + frac[:, None] * (take[:, idx].T - take[:, lo].T)  # [C, K] rate per instance
    overloaded = ~reach.any(axis=1)
    if overloaded.any():  # beyond every latency level: split in proportion to capacity
        cap = np.array([cv.capacity for cv in curves])
        share = counts[overloaded] * cap[None, :]
        per[overloaded] = rate * cap[None, :] / share.sum(axis=1, keepdims=True)
    # each layout's rate-weighted mean over its instances, TP by TP (all layouts at once; the same
    # arithmetic, in the same order, as summing per layout)
    att, lat, tau = (np.zeros(n) for _ in range(3))
    for k, cv in enumerate(curves):
        used = counts[:, k] != 0
        if not used.any():
            continue
        r = per[:, k]
        w = counts[:, k] * r / rate
        # beyond the table the requests in time are served no faster: attainment falls as 1 / λ
        beyond = np.maximum(r, cv.rates[-1])
        att = np.where(used, att + w * np.interp(r, cv.rates, cv.attainment) * cv.rates[-1] / beyond, att)
        lat = np.where(used, lat + w * np.interp(r, cv.rates, cv.latency), lat)
        tau = np.where(used, tau + w * np.interp(r, cv.rates, cv.tau), tau)
    return att, lat, tau


def _overload(counts: np.ndarray, curves: Sequence[Curves], rate: float, horizon_s: float,
              tau: np.ndarray) -> np.ndarray:
    """Past a layout's capacity C (full batches at the mean τ it is predicted to run) nothing is
    refused, so the late work is still served and a backlog grows at λ − C: a request arriving t
    seconds into the horizon waits about (1 − C/λ)·t more (the backlog over the rate it drains
    at). Over `horizon_s` that adds (1 − C/λ)·H/2 to the mean latency (returned: the term), which
    the chain alone (where a miss costs nothing) does not see; its attainment is left as the chain
    finds it."""
    cap = np.zeros(len(counts))
    for k, cv in enumerate(curves):
        if cv.capacity_by_tau is None or cv.pressed:  # under pressure a backlog runs everyone at the floor
            cap += counts[:, k] * cv.capacity
        else:  # the grid is descending; np.interp wants it ascending
            cap += counts[:, k] * np.interp(tau, cv.taus[::-1], cv.capacity_by_tau[::-1])
    excess = np.maximum(1.0 - cap / rate, 0.0)
    return excess * horizon_s / 2.0


def _inverse(cv: Curves, levels: np.ndarray) -> np.ndarray:
    """Highest arrival rate at which the instance's latency stays <= each level (0 if none)."""
    lat = np.maximum.accumulate(np.where(np.isfinite(cv.latency), cv.latency, np.inf))
    finite = np.isfinite(lat)
    if not finite.any():
        return np.zeros_like(levels)
    lat, rates = lat[finite], cv.rates[finite]
    out = np.interp(levels, lat, rates, left=0.0, right=rates[-1])
    return np.where(levels < lat[0], 0.0, out)
