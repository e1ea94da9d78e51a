"""`python -m dilaserve_jax.bench.policies`: SLO attainment, latency and accuracy of the scheduling
policies on one real instance (Engine + JaxRunner, real clock, in-process, no network).

1. Compiles the steps the workload needs and measures the step-latency profile on them
   (`serving.executor.profiling.measure_profile`); the schedulers use the latency model fitted to it.
2. Capacity: every prompt of the held-out pool alone on the idle instance at the static τ (its idle
   latency, and whether its answer is valid there: the per-prompt reference the accuracy drop is
   paired against), then the whole pool at once (throughput, requests/s, with all slots).
3. For each rate: one Poisson arrival trace of pool prompts over `--duration` seconds, or a window of
   a trace CSV scaled in time to the rate (`--trace`); each request's SLO is a multiple, uniform in
   `--slo-range`, of its own idle latency, or `--slo-factor` times its task's median idle latency
   (`bench/policies_workload.py`). Every run serves the same trace, one after another (the order
   rotates per rate, so background load drifts evenly): fcfs-static, edf-static, dilaserve exactly
   as serve ships it (`--defaults-row`: its τ floor, the eval rows' accuracy plateau as ceiling, its
   budget measured from there, best-effort admission), and dilaserve once per accuracy-loss budget
   of the sweep at `--tau-min`/`--tau-max` (plus the fixed-floor baseline at the finite positive
   budgets). Answers are graded with the task graders; refused requests count as SLO misses.

The pool skips the held-out problems the shipped eval rows were measured on (`--pool-skip`), so the
accuracy model is never tested on the problems it was calibrated with.

Clocks: `--clock real` (default) serves in real time, so other jobs on the machine slow the steps
and the scheduling alike. `--clock modeled` runs the same real steps (the same tokens, the same
graded answers) but advances a virtual clock by each step's measured time from the start-up
profile (its (kind, batch, canvas, block) shape), so a run is reproducible and other load cannot
touch it; host-side scheduling time is then not counted.

This module is the sweep and the command; the serving side (the pool, the profile, one serving run,
the flags of the workload) is `bench/policies_bench.py`, the table and plots `bench/policies_report.py`.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import dataclass

import numpy as np

from dilaserve_jax.bench.policies_bench import Bench
from dilaserve_jax.bench.policies_config import BenchConfig, budget_label
from dilaserve_jax.bench.policies_report import (format_table, headline, paired_drop, plot_pareto, plot_rates,
                                                 run_row)
from dilaserve_jax.core.cli import add_config_arguments, config_from_args, opt, returns_exit_status, setup_logging
from dilaserve_jax.serve import DEFAULT_COMPILE_CACHE

log = logging.getLogger(__name__)


def run(cfg: BenchConfig, progress: bool = True) -> tuple[list[dict], dict, dict]:
    """The sweep: a table row per run and rate, the capacity info, every request's record per run."""
    bench = Bench(cfg, progress, log)
    bench.build()
    idle, cap = bench.capacity()
    info = {"capacity_rps": cap, "idle_latency_mean": float(np.mean(idle)), "idle_latency_max": float(np.max(idle)),
            "pool": len(bench.items), "pool_skip": cfg.pool_skip, "slots": cfg.slots, "slo_range": list(cfg.slo_range),
            "duration": cfg.duration, "tau_range": [cfg.tau_min, cfg.tau_max], "static_tau": cfg.static_tau,
            "workload": bench.workload.describe(), "admission": cfg.admission,
            "reference_accuracy": float(np.mean(bench.reference)), "latency_model": bench.latency.label,
            "fit": str(bench.latency.report), "clock": cfg.clock,
            "profile_points": [[p.kind.label, p.batch, p.canvas, p.block, p.seconds] for p in bench.profile.points],
            "host_load_at_start": os.getloadavg()[0], "host_cpus": os.cpu_count()}
    log.info(f"capacity at τ={cfg.static_tau}: {cap:.2f} req/s with {cfg.slots} slots; idle latency mean "
             f"{info['idle_latency_mean'] * 1e3:.0f} ms, max {info['idle_latency_max'] * 1e3:.0f} ms; pool of "
             f"{len(bench.items)} valid at τ={cfg.static_tau}: {100 * info['reference_accuracy']:.1f}%")
    rates = cfg.rates or tuple(round(f * cap, 2) for f in cfg.load_factors)
    floor_of = bench.floor_of()
    if floor_of is not None:
        info["fixed_floor"] = {budget_label(b): floor_of(b) for b in cfg.budgets}
        log.info("fixed floor per budget (lowest τ whose pooled loss vs τ_max is within it): "
                 + ", ".join(f"{k}: {v:g}" for k, v in info["fixed_floor"].items()))
    shipped = bench.shipped() if cfg.defaults_row else None
    if shipped is not None:
        info["defaults"] = {"policy": shipped.policy, "tau_range": [shipped.tau_min, shipped.tau_max],
                            "budget": shipped.budget, "budget_mode": shipped.budget_mode,
                            "admission": shipped.admission}
        log.info(f"dilaserve (defaults): τ in [{shipped.tau_min:g}, {shipped.tau_max:g}], budget "
                 f"{budget_label(shipped.budget)} points from τ {shipped.tau_max:g} ({shipped.budget_mode}), "
                 f"{shipped.admission} admission")
    log.info(bench.workload.describe())
    runs = cfg.runs(floor_of, shipped)
    rows, records = [], {}
    for k, rate in enumerate(rates):
        pooled: dict[tuple, list] = {r: [] for r in runs}
        busy = {r: [0.0, 0.0] for r in runs}
        quality: dict[tuple, list] = {r: [] for r in runs}  # the instance's own accounting, per trace
        for t in range(cfg.traces):  # every run serves the same traces; the order rotates
            trace = bench.trace(rate, idle, k if t == 0 else 1000 * t + k)
            shift = (k + t) % len(runs)
            for policy, budget, mode in runs[shift:] + runs[:shift]:
                desc = f"{policy} {mode} {budget_label(budget)} @ {rate:g}/s, trace {t + 1}/{cfg.traces}"
                reqs = bench.serve(policy, trace, desc, budget, mode)
                pooled[(policy, budget, mode)] += [rec | {"trace": t} for rec in bench.records(reqs)]
                busy[(policy, budget, mode)][0] += bench.last_timing.step_s
                busy[(policy, budget, mode)][1] += bench.last_timing.wall_s
                if bench.last_quality is not None:
                    quality[(policy, budget, mode)].append(bench.last_quality.as_dict())
        by_run = {}
        for (policy, budget, mode), recs in pooled.items():
            records[f"{policy}|{mode}|{budget_label(budget)}|{rate:g}"] = recs
            by_run[(policy, budget, mode)] = run_row(policy, budget, mode, rate, recs, quality[(policy, budget, mode)],
                                                     *busy[(policy, budget, mode)], duration=cfg.duration * cfg.traces)
            by_run[(policy, budget, mode)]["host_load"] = os.getloadavg()[0]  # other jobs on the machine
            if mode == "defaults":
                by_run[(policy, budget, mode)]["budget_mode"] = shipped.budget_mode
        base = by_run[("fcfs-static", None, "-")]
        base_met = [r["met"] for r in pooled[("fcfs-static", None, "-")]]
        for run_key in runs:
            row = by_run[run_key] | {"load": rate / cap}
            row["slo_gain"] = row["slo_attainment"] - base["slo_attainment"]
            diffs = np.array([int(r["met"]) - int(b) for r, b in zip(pooled[run_key], base_met)], float)
            row["slo_gain_ci"] = 1.96 * float(diffs.std(ddof=1)) / np.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
            row["latency_change"] = row["mean_latency"] / base["mean_latency"] - 1
            row["accuracy_drop"] = base["accuracy"] - row["accuracy"]
            row["paired_drop_vs_fcfs"] = paired_drop(pooled[("fcfs-static", None, "-")], pooled[run_key])
            rows.append(row)
            log.info(format_table([row], header=False))
    return rows, info, records


@dataclass(frozen=True, slots=True)
class PoliciesCommand:
    """What the command does with the results, and how it runs besides the benchmark itself."""

    json: bool = opt(False, "print the rows, the capacity info and every request's record (τ trajectory, graded "
                            "validity, predicted loss) as JSON instead of the table")
    plot: str | None = opt(None, "write attainment and mean latency vs rate to this PNG", metavar="PNG")
    pareto: str | None = opt(None, "write SLO gain vs measured accuracy drop (per budget) to this PNG", metavar="PNG")
    compile_cache: str = opt(DEFAULT_COMPILE_CACHE, "persistent XLA compilation cache directory, or 'none'",
                             default_text="~/.cache/dilaserve_jax/xla")
    progress: bool = opt(True, "progress bars on stderr")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dilaserve_jax.bench.policies",
        description="Serve Poisson arrivals (or a trace's, scaled to each rate) of held-out task prompts on one real "
                    "instance with each scheduling policy (fcfs-static, edf-static, dilaserve as serve ships it, and "
                    "dilaserve at each accuracy-loss budget) at several request rates; print SLO attainment (over "
                    "all requests and over the served ones), mean/p99 latency and that of late answers, accuracy "
                    "and its drop vs fcfs-static (paired per prompt, with a 95% confidence interval), predicted "
                    "loss, mean τ and tokens per step.")
    add_config_arguments(p, BenchConfig, exclude=("static_tau",))
    return add_config_arguments(p, PoliciesCommand)


@returns_exit_status
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg, command = config_from_args(BenchConfig, args, parser), config_from_args(PoliciesCommand, args, parser)
    setup_logging(log)
    try:
        from dilaserve_jax.decoding.compiled import enable_compile_cache

        enable_compile_cache(command.compile_cache)
        rows, info, records = run(cfg, command.progress)
    except (ValueError, FileNotFoundError) as err:
        log.error(f"error: {err}")
        return 2
    report = f"{format_table(rows)}\n{headline(rows)}"
    if command.json:  # the table and headline still go to stderr
        print(json.dumps({"info": info, "rows": rows, "requests": records}))
        log.info(report)
    else:
        print(report)
    if command.plot:
        plot_rates(rows, info, command.plot)
        log.info(f"wrote {command.plot}")
    if command.pareto:
        plot_pareto(rows, command.pareto)
        log.info(f"wrote {command.pareto}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
