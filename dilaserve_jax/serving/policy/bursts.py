"""How unevenly arrivals come within the controller's window: the shares of the arrivals and the
rates of the bursts they came in, for `layout_eval.evaluate_layouts(spread=)` (see the controller's
module doc, "Bursts")."""
from __future__ import annotations

from typing import Sequence

import numpy as np


def burst_spread(times: Sequence[float], start: float, end: float, bin_s: float,
                 levels: int = 8) -> list[tuple[float, float]] | None:
    """How unevenly arrivals at `times` (within [start, end)) come, as (multiple of the mean rate,
    share of the arrivals) pairs for `evaluate_layouts`: the arrivals counted in bins of `bin_s`,
    each bin's rate shrunk towards the mean by the share of the counts' variance that Poisson
    noise explains (so Poisson arrivals give the mean alone, and bursts keep their excess), then
    grouped into at most `levels` arrival-weighted quantiles. None when there is nothing beyond
    the noise (a Poisson load is priced at its mean rate as before)."""
    n_bins = int((end - start) // bin_s) if bin_s > 0 else 0
    if n_bins < 4 or len(times) < 2 * n_bins:
        return None
    t = np.asarray(times, dtype=np.float64)
    t = t[(t >= end - n_bins * bin_s) & (t < end)]
    counts = np.bincount(((t - (end - n_bins * bin_s)) // bin_s).astype(np.int64), minlength=n_bins)[:n_bins]
    mean, var = counts.mean(), counts.var(ddof=1)
    if mean <= 0 or var <= 2.0 * mean:  # within about Poisson noise (dispersion index up to 2)
        return None
    rates = mean + (counts - mean) * np.sqrt((var - mean) / var)
    rates = np.maximum(rates, 0.0)
    order = np.argsort(rates)
    rates, weight = rates[order], counts[order].astype(np.float64)  # (mean > 0: some arrivals)
    # arrival-weighted quantile groups: each level holds about an equal share of the arrivals
    cum = np.cumsum(weight) / weight.sum()
    group = np.minimum((cum * levels - 1e-9).astype(np.int64), levels - 1)
    out = []
    for g in np.unique(group):
        m = group == g
        w = weight[m].sum()
        if w > 0:
            out.append((float((rates[m] * weight[m]).sum() / w / mean), float(w / weight.sum())))
    return out
