"""Rows, table, headline and plots of the policies benchmark (pure Python + numpy; matplotlib to plot)."""
from __future__ import annotations

import math

import numpy as np

from dilaserve_jax.sim.report import summarize


def _label(budget) -> str:
    return "inf" if budget is None else f"{budget:g}"


def run_row(policy: str, budget, mode: str, rate: float, recs: list[dict], quality: list[dict], busy: float,
            wall: float, *, duration: float | None = None) -> dict:
    """One run's row: the shared summary of its request records (`sim.report.summarize`; see
    `Bench.records`), the accuracy drop paired per prompt against the prompt alone at the static τ,
    and the instance's own quality accounting (one snapshot per trace)."""
    done = [r for r in recs if r["state"] == "FINISHED_OK"]
    diffs = np.array([int(r["valid_at_static_tau"]) - int(r["valid"]) for r in done], dtype=float)
    n = len(diffs)
    late = [r["latency"] for r in done if not r["met"]]
    return {"policy": policy, "mode": mode, "budget": budget, "rate": rate, **summarize(recs, duration=duration),
            "served_attainment": sum(r["met"] for r in done) / len(done) if done else math.nan,  # refusals left out
            "late": len(late), "late_latency": float(np.mean(late)) if late else math.nan,
            # measured loss paired per prompt: valid at the static τ alone minus valid here (points)
            "paired_drop": 100 * float(diffs.mean()) if n else float("nan"),
            "paired_drop_ci": 100 * 1.96 * float(diffs.std(ddof=1)) / math.sqrt(n) if n > 1 else float("nan"),
            "quality": quality, "step_busy_s": busy, "wall_s": wall}


def paired_drop(base: list[dict], recs: list[dict]) -> float:
    """Accuracy lost per request against `base` (the same trace's requests, in the same order), in
    points: over the requests both completed and graded, valid in `base` minus valid here."""
    both = [(b["valid"], r["valid"]) for b, r in zip(base, recs) if b["valid"] is not None and r["valid"] is not None]
    return 100 * float(np.mean([int(b) - int(r) for b, r in both])) if both else math.nan


def run_name(r: dict) -> str:
    return f"{r['policy']} (defaults)" if r["mode"] == "defaults" else r["policy"]


# SLO %: met / all requests (refused ones miss); srv %: met / served; late s: mean latency of the served
# late; vs fcfs: accuracy lost per request against fcfs-static on the same trace
HEAD = (f"{'policy':<21}{'mode':>9}{'budget':>7}{'req/s':>7}{'load':>6}{'n':>5}{'rej':>5}{'SLO %':>7}{'srv %':>7}"
        f"{'ΔSLO':>7}{'mean s':>8}{'Δlat %':>8}{'p99 s':>7}{'late s':>7}{'acc %':>7}{'drop':>7}{'paired ± 95%':>15}"
        f"{'vs fcfs':>8}{'pred':>6}{'τ':>6}{'tok/st':>7}")


def format_row(r: dict) -> str:
    gain = f"{100 * r['slo_gain']:+7.1f}" if "slo_gain" in r else f"{'':>7}"
    dlat = f"{100 * r['latency_change']:+8.0f}" if "latency_change" in r else f"{'':>8}"
    drop = f"{100 * r['accuracy_drop']:+7.1f}" if "accuracy_drop" in r else f"{'':>7}"
    paired = f"{r['paired_drop']:+.2f} ± {r['paired_drop_ci']:.2f}"
    mode = r.get("budget_mode", r["mode"])
    return (f"{run_name(r):<21}{mode:>9}{_label(r['budget']) if r['policy'] == 'dilaserve' else '-':>7}"
            f"{r['rate']:>7.2f}{r.get('load', float('nan')):>6.2f}{r['requests']:>5}{r['rejected']:>5}"
            f"{100 * r['slo_attainment']:>7.1f}{100 * r.get('served_attainment', math.nan):>7.1f}{gain}"
            f"{r['mean_latency']:>8.3f}{dlat}{r['p99_latency']:>7.2f}{r.get('late_latency', math.nan):>7.2f}"
            f"{100 * r['accuracy']:>7.1f}{drop}{paired:>15}{r.get('paired_drop_vs_fcfs', math.nan):>+8.2f}"
            f"{r.get('predicted_loss_points', math.nan):>6.2f}{r['mean_tau']:>6.3f}{r['tokens_per_step']:>7.2f}")


def format_table(rows: list[dict], header: bool = True) -> str:
    lines = [HEAD, "-" * len(HEAD)] if header else []
    return "\n".join([*lines, *map(format_row, rows)])


def _find(rows, rate, policy, mode="-", budget=None):
    return next((r for r in rows if r["rate"] == rate and r["policy"] == policy and r["mode"] == mode
                 and r["budget"] == budget), None)


def defaults_lines(rows: list[dict]) -> list[str]:
    """dilaserve as shipped against both static policies at every rate."""
    lines = []
    for rate in sorted({r["rate"] for r in rows}):
        d = next((r for r in rows if r["rate"] == rate and r["mode"] == "defaults"), None)
        f, e = _find(rows, rate, "fcfs-static"), _find(rows, rate, "edf-static")
        if d is None or f is None or e is None:
            continue
        lines.append(f"at {rate:g} req/s ({d.get('load', math.nan):.2f}x capacity) dilaserve (defaults) attains "
                     f"{100 * d['slo_attainment']:.1f}%: {100 * (d['slo_attainment'] - f['slo_attainment']):+.1f} "
                     f"points vs fcfs-static, {100 * (d['slo_attainment'] - e['slo_attainment']):+.1f} vs edf-static; "
                     f"mean latency {100 * (d['mean_latency'] / f['mean_latency'] - 1):+.0f}% vs fcfs-static; "
                     f"accuracy lost per request vs fcfs-static {d.get('paired_drop_vs_fcfs', math.nan):+.2f} points; "
                     f"{d['rejected']} refused")
    return lines


def headline(rows: list[dict]) -> str:
    """dilaserve as shipped against the static policies at every rate; then dilaserve vs fcfs-static at
    every rate where fcfs-static attains <= 50%: budget 1 point, and how much of it scheduling and load
    control alone (budget 0) and the fixed floor give."""
    rates = sorted({r["rate"] for r in rows})
    lines = defaults_lines(rows)
    overload = [x for x in rates if _find(rows, x, "fcfs-static")["slo_attainment"] <= 0.5]
    if not overload:
        return "\n".join([*lines, "fcfs-static attains > 50% at every rate measured: no overload point to compare at"])
    for rate in overload:
        f = _find(rows, rate, "fcfs-static")
        lines.append(f"at {rate:g} req/s (fcfs-static attains {100 * f['slo_attainment']:.1f}%):")
        for label, mode, budget in (("budget 1 point", "adaptive", 1.0), ("budget 0 (scheduling alone)", "adaptive", 0.0),
                                    ("fixed floor, 1 point", "floor", 1.0), ("unbounded", "adaptive", None)):
            d = _find(rows, rate, "dilaserve", mode, budget)
            if d is None and mode == "floor":  # its floor is the budget-0 floor: that run is this policy
                d = _find(rows, rate, "dilaserve", "adaptive", 0.0)
                label += " (= budget 0: same floor)"
            if d is None:
                continue
            lines.append(f"  dilaserve {label}: {100 * d['slo_gain']:+.1f} ± {100 * d['slo_gain_ci']:.1f} points SLO "
                         f"attainment, mean latency "
                         f"{100 * d['latency_change']:+.0f}%, accuracy {100 * d['accuracy']:.1f}% (drop "
                         f"{100 * d['accuracy_drop']:+.1f} points vs fcfs-static; paired per prompt "
                         f"{d['paired_drop']:+.2f} ± {d['paired_drop_ci']:.2f}), predicted "
                         f"{d.get('predicted_loss_points', math.nan):.2f}")
    return "\n".join(lines)


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plots need matplotlib: pip install 'dilaserve-jax[plot]' (or pip install matplotlib)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_rates(rows: list[dict], info: dict, path: str) -> None:
    """SLO attainment and mean latency vs rate: the static policies and dilaserve at each budget."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    series = [("fcfs-static", "-", None), ("edf-static", "-", None)]
    series += sorted({("dilaserve", "defaults", r["budget"]) for r in rows if r["mode"] == "defaults"}, key=str)
    series += sorted({("dilaserve", r["mode"], r["budget"]) for r in rows if r["policy"] == "dilaserve"
                      and r["mode"] == "adaptive"}, key=lambda s: math.inf if s[2] is None else s[2])
    for policy, mode, budget in series:
        rs = sorted((r for r in rows if (r["policy"], r["mode"], r["budget"]) == (policy, mode, budget)),
                    key=lambda r: r["rate"])
        label = (policy if policy != "dilaserve" else "dilaserve (defaults)" if mode == "defaults"
                 else f"dilaserve, budget {_label(budget)}")
        x = [r["rate"] for r in rs]
        axes[0].plot(x, [100 * r["slo_attainment"] for r in rs], "o-", label=label, ms=3)
        axes[1].plot(x, [r["mean_latency"] for r in rs], "o-", label=label, ms=3)
    for ax, title in zip(axes, ("SLO attainment (%)", "mean latency (s)")):
        ax.axvline(info["capacity_rps"], color="grey", ls=":", lw=1)
        ax.set_xlabel(f"request rate (req/s); dotted: capacity at τ={info['static_tau']}")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def plot_pareto(rows: list[dict], path: str) -> None:
    """SLO attainment gain over fcfs-static vs measured accuracy drop (paired, 95% CI), one panel per rate."""
    plt = _pyplot()
    rates = sorted({r["rate"] for r in rows})
    fig, axes = plt.subplots(1, len(rates), figsize=(3.2 * len(rates), 3.3), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        for mode, style in (("adaptive", "o-"), ("floor", "s--")):
            rs = sorted((r for r in rows if r["rate"] == rate and r["policy"] == "dilaserve" and r["mode"] == mode),
                        key=lambda r: math.inf if r["budget"] is None else r["budget"])
            if not rs:
                continue
            x = [r["paired_drop"] for r in rs]
            y = [100 * r["slo_gain"] for r in rs]
            ax.errorbar(x, y, xerr=[r["paired_drop_ci"] for r in rs], fmt=style, ms=4, capsize=2, lw=1,
                        label="dilaserve" if mode == "adaptive" else "fixed floor")
            for r, xi, yi in zip(rs, x, y):
                ax.annotate(_label(r["budget"]), (xi, yi), fontsize=7, xytext=(3, 3), textcoords="offset points")
        e = _find(rows, rate, "edf-static")
        if e is not None:
            ax.plot([e["paired_drop"]], [100 * e["slo_gain"]], "k*", label="edf-static")
        ax.axvline(1.0, color="grey", ls=":", lw=1)
        load = next(r.get("load", float("nan")) for r in rows if r["rate"] == rate)
        ax.set_title(f"{rate:g} req/s ({load:.1f}× capacity)", fontsize=9)
        ax.set_xlabel("measured accuracy drop (points)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("SLO attainment gain vs fcfs-static (points)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
