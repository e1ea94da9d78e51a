"""One report for simulated and live runs: SLO attainment, latency, accuracy, τ, rejections, moves.

`summarize(records)` takes per-request records (the simulator's `RequestRecord`s, or the dicts the
live load generator and the policies benchmark write) and returns the same row either way; `format_table` prints rows,
`plot_rates` draws attainment, mean latency and accuracy against the request rate.
"""
from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence

import numpy as np

COLUMNS = (("system", "<24", "{}"), ("req/s", ">7", "{:.2f}"), ("n", ">6", "{}"), ("rej", ">5", "{}"),
           ("SLO %", ">7", "{:.1f}"), ("mean s", ">8", "{:.2f}"), ("p50 s", ">7", "{:.2f}"), ("p99 s", ">8", "{:.2f}"),
           ("acc %", ">7", "{:.1f}"), ("τ", ">6", "{:.3f}"), ("reconf", ">7", "{}"), ("moves", ">6", "{}"),
           ("wall s", ">7", "{:.1f}"))


def _get(r, name, default=None):
    return r.get(name, default) if isinstance(r, Mapping) else getattr(r, name, default)


def summarize(records: Iterable, *, duration: float | None = None) -> dict:
    """Attainment (rejected and failed requests count as misses), latency of completed requests,
    accuracy over completed requests with a known validity, mean τ over their steps."""
    recs = list(records)
    ok = [r for r in recs if _get(r, "state") == "FINISHED_OK"]
    lat = np.array([_get(r, "finish") - _get(r, "arrival") for r in ok], dtype=np.float64)
    graded = [r for r in ok if _get(r, "valid") is not None]
    steps = sum(_get(r, "steps", 0) for r in ok)
    committed = sum(_get(r, "committed", 0) for r in ok)
    low = sum(_get(r, "low_tau_positions", 0) for r in ok)
    arrivals = [_get(r, "arrival") for r in recs]
    span = duration if duration else (max(arrivals) - min(arrivals) if len(arrivals) > 1 else 0.0)
    out = {
        "requests": len(recs),
        "completed": len(ok),
        "rejected": sum(_get(r, "state") == "FINISHED_REJECTED" for r in recs),
        "failed": sum(_get(r, "state") not in ("FINISHED_OK", "FINISHED_REJECTED") for r in recs),
        "slo_attainment": sum(bool(_get(r, "met")) for r in recs) / max(1, len(recs)),
        "mean_latency": float(lat.mean()) if len(lat) else math.nan,
        "p50_latency": float(np.percentile(lat, 50)) if len(lat) else math.nan,
        "p90_latency": float(np.percentile(lat, 90)) if len(lat) else math.nan,
        "p99_latency": float(np.percentile(lat, 99)) if len(lat) else math.nan,
        "accuracy": sum(bool(_get(r, "valid")) for r in graded) / len(graded) if graded else math.nan,
        "graded": len(graded),
        "mean_tau": sum(_get(r, "tau_sum", 0.0) for r in ok) / steps if steps else math.nan,
        "tokens_per_step": committed / steps if steps else math.nan,
        "moves": sum(_get(r, "moves", 0) for r in recs),
        "offered_rate": len(recs) / span if span > 0 else math.nan,
    }
    paired = [r for r in graded if _get(r, "valid_p") is not None and _get(r, "valid_p_ref") is not None]
    if paired:  # simulated: expected accuracy and its drop vs τ_max on the same requests (no draw noise)
        out["expected_accuracy"] = sum(_get(r, "valid_p") for r in paired) / len(paired)
        out["accuracy_drop_points"] = 100 * sum(_get(r, "valid_p_ref") - _get(r, "valid_p") for r in paired) / len(paired)
    if any(_get(r, "predicted_loss") is not None for r in ok):
        out["predicted_loss_points"] = sum(_get(r, "predicted_loss", 0.0) or 0.0 for r in ok) / max(1, len(ok))
    if low:
        out["extrapolated_share"] = low / max(1, committed)
    return out


def format_row(row: Mapping) -> str:
    vals = {"system": row.get("system", ""), "req/s": row.get("rate", row.get("offered_rate", math.nan)),
            "n": row["requests"], "rej": row["rejected"], "SLO %": 100 * row["slo_attainment"],
            "mean s": row["mean_latency"], "p50 s": row["p50_latency"], "p99 s": row["p99_latency"],
            "acc %": 100 * row["accuracy"], "τ": row["mean_tau"], "reconf": row.get("reconfigurations", 0),
            "moves": row.get("migrations", row.get("moves", 0)), "wall s": row.get("wall_s", math.nan)}
    return "".join(f"{fmt.format(vals[name]):{align}}" for name, align, fmt in COLUMNS)


def format_table(rows: Sequence[Mapping]) -> str:
    head = "".join(f"{name:{align}}" for name, align, _ in COLUMNS)
    return "\n".join([head, "-" * len(head), *map(format_row, rows)])


def headline(rows: Sequence[Mapping], ours: str, statics: Sequence[str]) -> dict | None:
    """The paper's comparison: at the lowest rate where the best static system attains <= 50%,
    our attainment gain (points) and mean-latency change, and the accuracy change."""
    by = {(r["system"], round(r["rate"], 9)): r for r in rows}
    rates = sorted({round(r["rate"], 9) for r in rows if r["system"] == ours})
    for rate in rates:
        best = max((by[(s, rate)] for s in statics if (s, rate) in by), key=lambda r: r["slo_attainment"], default=None)
        if best is None or best["slo_attainment"] > 0.5 or (ours, rate) not in by:
            continue
        d = by[(ours, rate)]
        return {"rate": rate, "best_static": best["system"], "static_attainment": best["slo_attainment"],
                "attainment": d["slo_attainment"], "gain_points": 100 * (d["slo_attainment"] - best["slo_attainment"]),
                "latency_change": d["mean_latency"] / best["mean_latency"] - 1,
                "accuracy_change_points": 100 * (d["accuracy"] - best["accuracy"]),
                "accuracy_drop_points": d.get("accuracy_drop_points", math.nan) - best.get("accuracy_drop_points", 0.0),
                "latency": d["mean_latency"], "static_latency": best["mean_latency"]}
    return None


def plot_rates(rows: Sequence[Mapping], path: str, title: str = "") -> None:
    """Attainment, mean latency and accuracy against the request rate, one line per system."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plots need matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for system in dict.fromkeys(r["system"] for r in rows):
        rs = sorted((r for r in rows if r["system"] == system), key=lambda r: r["rate"])
        x = [r["rate"] for r in rs]
        style = "o-" if system.startswith("dilaserve auto") and "-" not in system[len("dilaserve auto"):] else ".--"
        axes[0].plot(x, [100 * r["slo_attainment"] for r in rs], style, label=system, ms=4)
        axes[1].plot(x, [r["mean_latency"] for r in rs], style, label=system, ms=4)
        # expected accuracy (mean P(valid) of the served requests) where simulated: no drawing noise
        axes[2].plot(x, [100 * r.get("expected_accuracy", r["accuracy"]) for r in rs], style, label=system, ms=4)
    for ax, name in zip(axes, ("SLO attainment (%)", "mean latency (s)", "accuracy (%), expected")):
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(name)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
