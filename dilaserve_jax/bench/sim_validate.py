"""`python -m dilaserve_jax.bench.sim_validate`: the simulator against the real engine on the same requests.

1. The real side is `bench.policies`'s (`bench/policies_bench.py`), its serving loop included
   (`Bench.serve`): the tiny model on one instance (Engine + JaxRunner, real clock, in-process), its
   step-latency profile measured on the workload's shapes, each pool prompt's idle latency and the
   instance's capacity; then, per load level, one Poisson trace of pool prompts with SLO =
   uniform(2, 6) × the prompt's idle latency, served by every policy. Every step's duration and
   shapes and the wall time of every engine iteration are recorded (`Bench.last_timing`).
   Every engine iteration is recorded too (`serving/cluster/iteration_trace.py`; compare one run
   with its simulation iteration by iteration with `bench.trace_diff`).
2. The simulated side, fed only what the real run measured (`bench/sim_inputs.py`): its step
   times per shape (the median of the run's own compiled calls of each kind, padded batch, length
   bucket and block; the start-up profile where a shape never occurred; `--step-source profile`
   uses the start-up profile alone), their noise (the run's slowdown over time, or the pooled
   spread), the host time per iteration (the mean per step, or `--host-model fit`: fitted on batch
   and queue depth from the iteration traces), and each request's work: a problem drawn from its
   task's shipped eval rows (the pool's prompts are held out from them), or `--work own`: the pool
   prompt's own commits where the real run measured them at one τ. The same requests, the same
   arrival times and SLOs, the same policies.
3. Both side by side per policy and rate. Each point is served `--repeats` times (3): a point is met
   when the simulation falls within the real passes' min–max of attainment widened by 5 points and
   of mean latency widened by 15%.

`--instances N` (N > 1): N real instances behind the serving router against N simulated ones
(`bench/sim_validate_pair.py`). The real side imports JAX (inside `measure_real`, `measure_pair`);
`--from` re-simulates saved real runs without it.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dilaserve_jax.bench.sim_inputs import host_models, run_inputs, simulate, step_time_model
from dilaserve_jax.core.cli import (add_config_arguments, config_from_args, opt, or_none, returns_exit_status,
                                    setup_logging)
from dilaserve_jax.serving.policy.latency import Profile
from dilaserve_jax.serving.policy.scheduler import POLICIES
from dilaserve_jax.sim.report import summarize

log = logging.getLogger("dilaserve_jax.bench.sim_validate")  # one logger, run as -m or imported (sim_validate_pair)

TARGET_POINTS = 5.0
TARGET_LATENCY = 0.15


@dataclass(frozen=True, slots=True)
class ValidateConfig:
    load_factors: tuple[float, ...] = opt((0.5, 1.0, 1.6), "request rates as multiples of the measured capacity")
    duration: float = opt(20.0, "seconds of arrivals per run")
    policies: tuple[str, ...] = opt((), "scheduling policies", choices=POLICIES, default_text="all three")
    instances: int = opt(1, "real instances of TP 1, one device and one pinned core each, behind the serving "
                            "router, against as many simulated ones (on CPU the command asks XLA for that many host "
                            "devices); the load factors are of their joint capacity. With --from: the saved run's")
    slots: int = opt(8, "slots of each instance")
    per_task: int = opt(6, "held-out problems per task in the pool")
    slo_range: tuple[float, float] = opt((2.0, 6.0), "SLO = uniform(LO, HI) x the prompt's idle latency",
                                         metavar=("LO", "HI"))
    seed: int = opt(0, "workload seed")
    max_accuracy_drop: float | None = opt(1.0, "dilaserve's accuracy budget in points, on both sides ('inf': "
                                               "unbounded)", parse=or_none(float, "inf", "none", "unbounded"))
    sim_seeds: int = opt(3, "simulator seeds per point, averaged")
    repeats: int = opt(3, "serve every real point this many times: the real server's own run-to-run spread, "
                          "against which the simulation is judged")
    out: str | None = opt(None, "write the measured profile (profile.json, usable as --profile of the simulator), "
                                "the real run's measurements (measured.json) and the comparison here", metavar="DIR")
    from_file: str | None = opt(None, "skip the real side: re-simulate the real runs saved in FILE (measured.json of "
                                      "--out)", name="--from", metavar="FILE")
    step_source: str = opt("run", "simulated step times: the run's own measured steps per shape, falling back to "
                                  "the start-up profile (run), or the start-up profile alone (profile)",
                           choices=("run", "profile"))
    noise: str = opt("timeline", "step-time noise: replay each run's measured slowdown over time (timeline: this "
                                 "machine is shared, and its contention comes in spells) or resample the pooled "
                                 "spread (iid)", choices=("timeline", "iid"))
    host_model: str = opt("mean", "simulated host time per iteration: the real runs' mean per step (mean), or "
                                  "fitted per policy on (batch, queue) from their iteration traces (fit)",
                          choices=("mean", "fit"))
    work: str = opt("eval", "each simulated request's commits: a problem drawn from its task's eval rows (eval), or "
                            "the pool prompt's own as the real run measured them where it ran at one τ (own)",
                    choices=("eval", "own"))
    json: bool = opt(False, "print the comparison as JSON")
    compile_cache: str = opt(os.path.join(os.path.expanduser("~"), ".cache", "dilaserve_jax", "xla"),
                             "persistent XLA compilation cache directory, or 'none'",
                             default_text="~/.cache/dilaserve_jax/xla")
    progress: bool = opt(True, "progress bars on stderr")

    def __post_init__(self):
        if not self.load_factors or any(f <= 0 for f in self.load_factors) or self.duration <= 0:
            raise ValueError("load factors and the duration must be positive")
        if self.slots < 1 or self.per_task < 1 or self.sim_seeds < 1 or self.repeats < 1 or self.instances < 1:
            raise ValueError("instances, slots, per-task, sim-seeds and repeats must be at least 1")
        if not 0 < self.slo_range[0] <= self.slo_range[1]:
            raise ValueError(f"bad SLO range {self.slo_range}")
        if self.max_accuracy_drop is not None and self.max_accuracy_drop < 0:
            raise ValueError(f"the accuracy budget is points >= 0 or 'inf', got {self.max_accuracy_drop}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dilaserve_jax.bench.sim_validate",
        description="Replay one Poisson trace through the real in-process engine (tiny model, one instance, or "
                    "--instances N behind the serving router) at "
                    "several loads and policies, then through the simulator fed that run's measured profile, step-time "
                    "spread and host overhead and the shipped eval rows; print both side by side.")
    return add_config_arguments(p, ValidateConfig)


def _mean_rows(results, duration: float) -> dict:
    rows = [summarize(r.records, duration=duration) for r in results]
    keys = ("slo_attainment", "mean_latency", "p99_latency", "accuracy", "mean_tau", "rejected", "requests")
    return {k: float(np.mean([r[k] for r in rows])) for k in keys} | {"seeds": len(rows)}


def compare(real: dict, sim: dict) -> dict:
    """The simulated point against one real run: within the targets of it."""
    return compare_spread([real], sim)


def compare_spread(reals: list[dict], sim: dict) -> dict:
    """The simulated point against the real runs of it: Δ to their mean; met when the simulation falls
    within their min–max widened by the targets (±5 points of attainment, ±15% of mean latency)."""
    att = [r["slo_attainment"] for r in reals]
    lat = [r["mean_latency"] for r in reals]
    mean_lat = float(np.mean(lat))
    d_att = 100 * (sim["slo_attainment"] - float(np.mean(att)))
    d_lat = sim["mean_latency"] / mean_lat - 1 if mean_lat > 0 else math.nan
    ok_att = min(att) - TARGET_POINTS / 100 - 1e-12 <= sim["slo_attainment"] <= max(att) + TARGET_POINTS / 100 + 1e-12
    ok_lat = min(lat) * (1 - TARGET_LATENCY) <= sim["mean_latency"] <= max(lat) * (1 + TARGET_LATENCY)
    return {"d_attainment_points": d_att, "d_latency": d_lat, "within": bool(ok_att and ok_lat),
            "real_attainment_range": [min(att), max(att)], "real_latency_range": [min(lat), max(lat)],
            "passes": len(reals)}


def group_points(rows: list[dict]) -> list[dict]:
    """Per (policy, rate): its passes' real summaries, the simulation averaged over them, the comparison."""
    points: dict[tuple, list[dict]] = {}
    for r in rows:
        points.setdefault((r["policy"], r["rate"]), []).append(r)
    out = []
    for (policy, rate), rs in sorted(points.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        reals = [r["real"] for r in rs]
        sim = {k: float(np.mean([r["sim"][k] for r in rs])) for k in rs[0]["sim"]}
        real = {k: float(np.mean([x[k] for x in reals])) for k in ("slo_attainment", "mean_latency", "accuracy",
                                                                   "mean_tau", "requests")}
        out.append({"policy": policy, "rate": rate, "load": rs[0]["load"], "real": real, "sim": sim,
                    "compare": compare_spread(reals, sim)})
    return out


def format_points(points: list[dict]) -> str:
    head = (f"{'policy':<12}{'req/s':>7}{'load':>6}{'pass':>5}{'n':>5} | {'SLO% real (min-max)':>20}{'sim':>7}"
            f"{'Δpts':>7} | {'mean s real (min-max)':>22}{'sim':>7}{'Δ':>6} | {'acc% real':>9}{'sim':>6} | "
            f"{'τ real':>6}{'sim':>6} | ok")
    lines = [head, "-" * len(head)]
    for p in points:
        a, s, c = p["real"], p["sim"], p["compare"]
        att, lat = c["real_attainment_range"], c["real_latency_range"]
        lines.append(f"{p['policy']:<12}{p['rate']:>7.2f}{p['load']:>6.2f}{c['passes']:>5}{a['requests']:>5.0f} | "
                     f"{100 * a['slo_attainment']:>7.1f} ({100 * att[0]:>4.1f}-{100 * att[1]:>4.1f})"
                     f"{100 * s['slo_attainment']:>7.1f}{c['d_attainment_points']:>+7.1f} | "
                     f"{a['mean_latency']:>8.3f} ({lat[0]:.3f}-{lat[1]:.3f}){s['mean_latency']:>7.3f}"
                     f"{100 * c['d_latency']:>+5.0f}% | {100 * a['accuracy']:>9.1f}{100 * s['accuracy']:>6.1f} | "
                     f"{a['mean_tau']:>6.3f}{s['mean_tau']:>6.3f} | {'yes' if c['within'] else 'no'}")
    return "\n".join(lines)


def open_bench(cfg: ValidateConfig):
    """The policies benchmark's pool, model, instance and start-up profile (JAX)."""
    from dilaserve_jax.bench.policies_bench import Bench, BenchConfig
    from dilaserve_jax.decoding.compiled import enable_compile_cache

    enable_compile_cache(cfg.compile_cache)
    bench_cfg = BenchConfig(model="tiny", load_factors=cfg.load_factors, duration=cfg.duration,
                            slo_range=cfg.slo_range, slots=cfg.slots, per_task=cfg.per_task, seed=cfg.seed)
    bench = Bench(bench_cfg, cfg.progress, log)
    bench.build()
    return bench


def serve_one(bench, policy: str, trace: list, desc: str, budget: float | None) -> dict:
    """One real run on the benchmark's one instance: its records, steps, busy time and iterations."""
    reqs = bench.serve(policy, trace, desc, budget, "adaptive")
    timing = bench.last_timing
    return {"records": bench.records(reqs), "steps": timing.steps, "busy_wall_s": timing.iterations_s,
            "overhead_ms": 1e3 * timing.host_s_per_step, "iterations": [r.to_json() for r in bench.last_trace]}


def sweep(cfg: ValidateConfig, bench, cap: float, idle: list[float], serve) -> list[dict]:
    """Every (repeat, load, policy) real run: `serve(policy, trace, desc, budget)` -> its measurements."""
    policies = cfg.policies or POLICIES
    runs = []
    for rep in range(cfg.repeats):  # the same traces again: how much the real server varies by itself
        for k, factor in enumerate(cfg.load_factors):
            rate = round(factor * cap, 2)
            trace = bench.trace(rate, idle, k)
            shift = (k + rep) % len(policies)
            for p in policies[shift:] + policies[:shift]:
                # every policy with the shipped eval rows' speed prior and accuracy budget
                runs.append({"policy": p, "rate": rate, "load": factor, "repeat": rep, "trace": trace}
                            | serve(p, trace, f"real {p} @ {rate:g}/s", cfg.max_accuracy_drop))
                log.info(f"real {p} @ {rate:g} req/s (pass {rep + 1}): "
                         f"{summarize(runs[-1]['records'], duration=cfg.duration)['slo_attainment']:.1%} attainment")
    return runs


def measured_json(cfg: ValidateConfig, bench, cap: float, runs: list[dict], t_start: float, **info) -> dict:
    """Everything the simulated side is fed, as plain JSON (`info`: more of the run's facts)."""
    bc, budget = bench.cfg, cfg.max_accuracy_drop
    items = [{"task": it.problem.task, "tokens": list(it.tokens), "answer": it.answer, "block": it.block}
             for it in bench.items]
    return {"info": {"budget": budget, "slots": cfg.slots, "static_tau": bc.static_tau,
                     "tau_range": [bc.tau_min, bc.tau_max], "capacity_rps": cap, "duration": cfg.duration,
                     "slo_range": list(cfg.slo_range), "profile_label": bench.profile.label,
                     "fit": str(bench.latency.report), "real_wall_s": time.perf_counter() - t_start} | info,
            "items": items, "runs": runs, "profile": bench.profile.to_json(),
            "prior": {str(t): v for t, v in bench.threshold_config(budget, "adaptive").prior},
            "eval_rows": bench.rows,
            "batch_buckets": list(bench.runner.decoder.config.batch_buckets),
            "length_buckets": sorted(set(bench.lengths.values()))}


def measure_real(cfg: ValidateConfig) -> dict:
    """The real side (JAX) on one instance: everything the simulated side is fed, as plain JSON."""
    t_start = time.perf_counter()
    bench = open_bench(cfg)
    idle, cap = bench.capacity()
    log.info(f"capacity at τ={bench.cfg.static_tau}: {cap:.2f} req/s; idle latency mean {1e3 * np.mean(idle):.0f} ms")
    runs = sweep(cfg, bench, cap, idle, lambda p, trace, desc, budget: serve_one(bench, p, trace, desc, budget))
    return measured_json(cfg, bench, cap, runs, t_start)


def compare_with_sim(measured: dict, seeds: int, source: str = "run", noise: str = "timeline",
                     host_model: str = "mean", work: str = "eval") -> dict:
    """The simulated side, fed only `measured`, side by side with the real runs (`sim_inputs.run_inputs`
    for noise, host_model "mean"/"fit" and work "eval"/"own"); one row per real run, and `points`:
    the runs of each (policy, rate) together."""
    info, duration = measured["info"], measured["info"]["duration"]
    instances = int(info.get("instances", 1))  # several: `sim_validate_pair`'s runs, behind the router
    step_time, latency, spread = step_time_model(measured, source)
    spread |= {"noise": noise, "host_model": host_model, "work": work}
    if host_model not in ("mean", "fit"):
        raise ValueError(f"host model must be mean or fit, got {host_model!r}")
    hosts = host_models(measured) if host_model == "fit" else {}
    spread["host"] = {p: h.describe() for p, h in hosts.items()}
    prior = {float(t): v for t, v in measured["prior"].items()} or None
    rows = []
    t_sim = time.perf_counter()
    for run_ in measured["runs"]:
        real = summarize(run_["records"], duration=duration)
        st, host, own = run_inputs(measured, run_, step_time, noise, hosts, work)
        sims = simulate(info, run_["policy"], run_["trace"], measured["items"], step_time=st, latency=latency,
                        prior=prior, seeds=seeds, eval_rows=measured.get("eval_rows"), host_time=host, own=own,
                        instances=instances)
        sim = _mean_rows(sims, duration)
        rows.append({"policy": run_["policy"], "rate": run_["rate"], "load": run_["load"],
                     "repeat": run_.get("repeat", 0), "real": real, "sim": sim, "compare": compare(real, sim),
                     "own_work": len(own or ())}
                    | ({"placed": placed_counts(run_["records"], sims)} if instances > 1 else {}))
    rows.sort(key=lambda r: (r["rate"], r["policy"], r["repeat"]))
    return {"info": info | {"step_time": spread, "sim_wall_s": time.perf_counter() - t_sim}, "rows": rows,
            "points": group_points(rows)}


def placed_counts(records: list[dict], sims: list) -> dict:
    """Requests per instance: where the real router placed them, and the simulated router (mean over seeds)."""
    real: dict[str, int] = {}
    for r in records:
        real[r.get("instance", "")] = real.get(r.get("instance", ""), 0) + 1
    sim: dict[str, float] = {}
    for res in sims:
        for r in res.records:
            sim[r.instance] = sim.get(r.instance, 0.0) + 1 / len(sims)
    return {"real": dict(sorted(real.items())), "sim": dict(sorted(sim.items()))}


def run(cfg: ValidateConfig) -> dict:
    if cfg.from_file:
        measured = json.loads(Path(cfg.from_file).read_text())
        log.info(f"real runs from {cfg.from_file} ({len(measured['runs'])} runs, "
                 f"{measured['info'].get('instances', 1)} instance(s))")
    else:
        if cfg.instances > 1:
            from dilaserve_jax.bench.sim_validate_pair import measure_pair

            measured = measure_pair(cfg)
        else:
            measured = measure_real(cfg)
        if cfg.out:
            d = Path(cfg.out)
            d.mkdir(parents=True, exist_ok=True)
            (d / "measured.json").write_text(json.dumps(measured, default=float))
            Profile.from_json(measured["profile"]).save(d / "profile.json")
            log.info(f"wrote {d / 'measured.json'} (re-simulate with --from) and {d / 'profile.json'}")
    out = compare_with_sim(measured, cfg.sim_seeds, cfg.step_source, cfg.noise, cfg.host_model, cfg.work)
    sp = out["info"]["step_time"]
    log.info(f"step time ({sp['source']}): actual/modelled median {sp['ratio_median']:.3f}, mean "
             f"{sp['ratio_mean']:.3f} (p10 {sp['ratio_p10']:.3f}, p90 {sp['ratio_p90']:.3f}) over {sp['steps']} steps; "
             f"host time per step {sp['overhead_per_step_ms']:.2f} ms")
    if cfg.out:
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        (Path(cfg.out) / f"validate_{cfg.step_source}_{cfg.noise}_{cfg.host_model}_{cfg.work}.json").write_text(
            json.dumps(out, indent=1, default=float))
    return out


@returns_exit_status
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    cfg = config_from_args(ValidateConfig, parser.parse_args(argv), parser)
    setup_logging(log)
    try:
        out = run(cfg)
    except (ValueError, FileNotFoundError) as err:
        log.error(f"error: {err}")
        return 2
    if cfg.json:
        print(json.dumps(out, indent=1, default=float))
    else:
        print(format_points(out["points"]))
        ok = sum(p["compare"]["within"] for p in out["points"])
        print(f"{ok}/{len(out['points'])} points within the targets (the real passes' min-max widened by ±"
              f"{TARGET_POINTS:g} points of attainment and ±{100 * TARGET_LATENCY:.0f}% of mean latency); real side "
              f"{out['info']['real_wall_s']:.0f} s, simulator {out['info']['sim_wall_s']:.1f} s")
        if out["info"].get("instances", 1) > 1:
            from dilaserve_jax.bench.sim_validate_pair import format_placed, met_per_policy

            print(met_per_policy(out["points"]))
            print(format_placed(out["rows"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
