"""`python -m dilaserve_jax.bench.sim_validate`: the simulator against the real engine on the same requests.

1. The real side is `bench.policies`'s (`bench/policies_bench.py`), its serving loop included
   (`Bench.serve`): the tiny model on one instance (Engine + JaxRunner, real clock, in-process), its
   step-latency profile measured on the workload's shapes, each pool prompt's idle latency and the
   instance's capacity; then, per load level, one Poisson trace of pool prompts with SLO =
   uniform(2, 6) × the prompt's idle latency, served by every policy. Every step's duration and
   shapes and the wall time of every engine iteration are recorded (`Bench.last_timing`).
2. The simulated side, fed only what the real run measured: its step times per shape (the median
   of the run's own compiled calls of each kind, padded batch, length bucket and block; the
   start-up profile where a shape never occurred; `--step-source profile` uses the start-up profile
   alone), the spread of actual over modelled step times (resampled), the host time per step
   outside the compiled calls, and the shipped eval rows (each pool prompt was among the eval's
   problems, so it replays its own measured commit trajectory and validity). The same requests,
   the same arrival times and SLOs, the same policies.
3. Both side by side per policy and rate, against the targets (attainment within 5 points, mean
   latency within 15%).

The real side imports JAX (inside `measure_real`); `--from` re-simulates saved real runs without it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dilaserve_jax.core.buckets import padded
from dilaserve_jax.core.cli import (add_config_arguments, config_from_args, opt, or_none, returns_exit_status,
                                    setup_logging)
from dilaserve_jax.serving.policy.latency import LatencyModel, Profile
from dilaserve_jax.serving.policy.scheduler import POLICIES
from dilaserve_jax.sim.executor import StepTimeModel
from dilaserve_jax.sim.quality import QualityModel
from dilaserve_jax.sim.report import summarize
from dilaserve_jax.sim.setup import ASSETS
from dilaserve_jax.sim.simulator import SimConfig, Simulation
from dilaserve_jax.sim.workload import RequestSpec

log = logging.getLogger(__name__)

TARGET_POINTS = 5.0
TARGET_LATENCY = 0.15


@dataclass(frozen=True, slots=True)
class ValidateConfig:
    load_factors: tuple[float, ...] = opt((0.5, 1.0, 1.6), "request rates as multiples of the measured capacity")
    duration: float = opt(20.0, "seconds of arrivals per run")
    policies: tuple[str, ...] = opt((), "scheduling policies", choices=POLICIES, default_text="all three")
    slots: int = opt(8, "slots of the instance")
    per_task: int = opt(6, "held-out problems per task in the pool")
    slo_range: tuple[float, float] = opt((2.0, 6.0), "SLO = uniform(LO, HI) x the prompt's idle latency",
                                         metavar=("LO", "HI"))
    seed: int = opt(0, "workload seed")
    max_accuracy_drop: float | None = opt(1.0, "dilaserve's accuracy budget in points, on both sides ('inf': "
                                               "unbounded)", parse=or_none(float, "inf", "none", "unbounded"))
    sim_seeds: int = opt(3, "simulator seeds per point, averaged")
    repeats: int = opt(1, "serve every real point this many times (the real server's own run-to-run spread)")
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
    json: bool = opt(False, "print the comparison as JSON")
    compile_cache: str = opt(os.path.join(os.path.expanduser("~"), ".cache", "dilaserve_jax", "xla"),
                             "persistent XLA compilation cache directory, or 'none'",
                             default_text="~/.cache/dilaserve_jax/xla")
    progress: bool = opt(True, "progress bars on stderr")

    def __post_init__(self):
        if not self.load_factors or any(f <= 0 for f in self.load_factors) or self.duration <= 0:
            raise ValueError("load factors and the duration must be positive")
        if self.slots < 1 or self.per_task < 1 or self.sim_seeds < 1 or self.repeats < 1:
            raise ValueError("slots, per-task, sim-seeds and repeats must be at least 1")
        if not 0 < self.slo_range[0] <= self.slo_range[1]:
            raise ValueError(f"bad SLO range {self.slo_range}")
        if self.max_accuracy_drop is not None and self.max_accuracy_drop < 0:
            raise ValueError(f"the accuracy budget is points >= 0 or 'inf', got {self.max_accuracy_drop}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dilaserve_jax.bench.sim_validate",
        description="Replay one Poisson trace through the real in-process engine (tiny model, one instance) at "
                    "several loads and policies, then through the simulator fed that run's measured profile, step-time "
                    "spread and host overhead and the shipped eval rows; print both side by side.")
    return add_config_arguments(p, ValidateConfig)


# --- the simulated side ------------------------------------------------------------------------
def simulate(bench_info: dict, policy: str, trace: list, items: list, *, step_time, latency, prior, seeds: int,
             eval_rows: list | None = None) -> list:
    rows = json.loads((ASSETS / "eval.json").read_text())
    specs = [RequestSpec(offset, items[i]["task"], tuple(items[i]["tokens"]), items[i]["answer"], items[i]["block"],
                         None, slo) for offset, i, slo in trace]
    out = []
    for seed in range(seeds):
        quality = QualityModel.from_eval_rows(rows, seed=seed)
        cfg = SimConfig(devices=1, policy=policy, layout="1x1", slots=bench_info["slots"],
                        static_tau=bench_info["static_tau"], tau_min=bench_info["tau_range"][0],
                        tau_max=bench_info["tau_range"][1], max_queue=10_000,
                        max_accuracy_drop=bench_info.get("budget"), seed=seed)
        res = Simulation(cfg, specs, step_time=step_time, latency=latency, quality=quality, prior=prior,
                         param_bytes=0.0, eval_rows=eval_rows).run()
        out.append(res)
    return out


def step_time_model(measured: dict, source: str = "run"):
    """The simulator's step time from what the real run measured (see module doc).

    source "run": the median duration of the run's own steps per shape (kind, padded batch, length
    bucket, block), where a step was one compiled call; the start-up profile for shapes the run never
    had. source "profile": the start-up profile alone. Either way the spread of actual over modelled
    step times is resampled as noise, and the host time per step outside the compiled calls is added."""
    prof = Profile.from_json(measured["profile"])
    latency = LatencyModel.from_profile(prof)
    table = {(int(p.kind), p.tp, p.batch, p.canvas, p.block): p.seconds for p in prof.points}
    batch_b, length_b = tuple(measured["batch_buckets"]), tuple(measured["length_buckets"])
    steps = [s for run in measured["runs"] for s in run["steps"]]
    if source == "run":
        seen: dict[tuple, list[float]] = {}
        for kind, shapes, t0, t1 in steps:
            groups = {(padded(c, length_b), k) for c, k in shapes}
            if len(groups) == 1:
                (l, k), = groups
                seen.setdefault((int(kind), 1, padded(len(shapes), batch_b), l, k), []).append(t1 - t0)
        table |= {key: float(np.median(v)) for key, v in seen.items()}
    elif source != "profile":
        raise ValueError(f"step-time source must be run or profile, got {source!r}")
    base = StepTimeModel(latency, table, batch_b, length_b)
    rng = np.random.default_rng(0)
    ratios = [(t1 - t0) / pred for kind, shapes, t0, t1 in steps
              if (pred := base.batch_seconds(kind, shapes, 1, rng)) > 0]
    busy = sum(run["busy_wall_s"] for run in measured["runs"])
    step_s = sum(t1 - t0 for _, _, t0, t1 in steps)
    overhead = max(0.0, (busy - step_s) / max(1, len(steps)))
    model = StepTimeModel(latency, table, batch_b, length_b, tuple(float(r) for r in ratios) or 0.0, overhead)
    return model, latency, {"source": source, "ratio_median": float(np.median(ratios)) if ratios else math.nan,
                            "ratio_mean": float(np.mean(ratios)) if ratios else math.nan,
                            "ratio_p10": float(np.percentile(ratios, 10)) if ratios else math.nan,
                            "ratio_p90": float(np.percentile(ratios, 90)) if ratios else math.nan,
                            "overhead_per_step_ms": 1e3 * overhead, "steps": len(steps)}


def _mean_rows(results, duration: float) -> dict:
    rows = [summarize(r.records, duration=duration) for r in results]
    keys = ("slo_attainment", "mean_latency", "p99_latency", "accuracy", "mean_tau", "rejected", "requests")
    return {k: float(np.mean([r[k] for r in rows])) for k in keys} | {"seeds": len(rows)}


def compare(real: dict, sim: dict) -> dict:
    d_att = 100 * (sim["slo_attainment"] - real["slo_attainment"])
    d_lat = sim["mean_latency"] / real["mean_latency"] - 1 if real["mean_latency"] > 0 else math.nan
    return {"d_attainment_points": d_att, "d_latency": d_lat,
            "within": abs(d_att) <= TARGET_POINTS and abs(d_lat) <= TARGET_LATENCY}


def real_repeatability(rows: list[dict]) -> dict:
    """(policy, rate) -> the second real pass against the first: (attainment points, relative mean latency)."""
    out = {}
    for r in rows:
        if r.get("repeat", 0) == 1:
            first = next((x for x in rows if x["policy"] == r["policy"] and x["rate"] == r["rate"]
                          and x.get("repeat", 0) == 0), None)
            if first is not None:
                out[(r["policy"], r["rate"])] = compare(first["real"], r["real"])["d_attainment_points"], \
                    compare(first["real"], r["real"])["d_latency"]
    return out


def format_rows(rows: list[dict]) -> str:
    head = (f"{'policy':<12}{'req/s':>7}{'load':>6}{'pass':>5}{'n':>5} | {'SLO% real':>9}{'sim':>7}{'Δpts':>7} | "
            f"{'mean s real':>11}{'sim':>7}{'Δ':>7} | {'acc% real':>9}{'sim':>6} | {'τ real':>6}{'sim':>6} | ok")
    lines = [head, "-" * len(head)]
    for r in rows:
        a, s, c = r["real"], r["sim"], r["compare"]
        lines.append(f"{r['policy']:<12}{r['rate']:>7.2f}{r['load']:>6.2f}{r.get('repeat', 0) + 1:>5}{a['requests']:>5.0f} | "
                     f"{100 * a['slo_attainment']:>9.1f}{100 * s['slo_attainment']:>7.1f}{c['d_attainment_points']:>+7.1f} | "
                     f"{a['mean_latency']:>11.3f}{s['mean_latency']:>7.3f}{100 * c['d_latency']:>+6.0f}% | "
                     f"{100 * a['accuracy']:>9.1f}{100 * s['accuracy']:>6.1f} | {a['mean_tau']:>6.3f}{s['mean_tau']:>6.3f} | "
                     f"{'yes' if c['within'] else 'no'}")
    return "\n".join(lines)


def measure_real(cfg: ValidateConfig) -> dict:
    """The real side (JAX): everything the simulated side is fed, as plain JSON."""
    from dilaserve_jax.bench.policies_bench import Bench, BenchConfig
    from dilaserve_jax.decoding.compiled import enable_compile_cache

    enable_compile_cache(cfg.compile_cache)
    policies = cfg.policies or POLICIES
    bench_cfg = BenchConfig(model="tiny", load_factors=cfg.load_factors, duration=cfg.duration,
                            slo_range=cfg.slo_range, slots=cfg.slots, per_task=cfg.per_task, seed=cfg.seed)
    t_start = time.perf_counter()
    bench = Bench(bench_cfg, cfg.progress, log)
    bench.build()
    idle, cap = bench.capacity()
    log.info(f"capacity at τ={bench_cfg.static_tau}: {cap:.2f} req/s; idle latency mean {1e3 * np.mean(idle):.0f} ms")
    budget = cfg.max_accuracy_drop
    info = {"budget": budget, "slots": cfg.slots, "static_tau": bench_cfg.static_tau,
            "tau_range": [bench_cfg.tau_min, bench_cfg.tau_max], "capacity_rps": cap, "duration": cfg.duration,
            "slo_range": list(cfg.slo_range), "profile_label": bench.profile.label, "fit": str(bench.latency.report)}
    items = [{"task": it.problem.task, "tokens": list(it.tokens), "answer": it.answer, "block": it.block}
             for it in bench.items]
    runs = []
    for rep in range(cfg.repeats):  # the same traces again: how much the real server varies by itself
        for k, factor in enumerate(bench_cfg.load_factors):
            rate = round(factor * cap, 2)
            trace = bench.trace(rate, idle, k)
            shift = (k + rep) % len(policies)
            for p in policies[shift:] + policies[:shift]:
                # every policy with the shipped eval rows' speed prior and accuracy budget
                reqs = bench.serve(p, trace, f"real {p} @ {rate:g}/s", budget, "adaptive")
                timing = bench.last_timing
                runs.append({"policy": p, "rate": rate, "load": factor, "repeat": rep, "trace": trace,
                             "records": bench.records(reqs), "steps": timing.steps,
                             "busy_wall_s": timing.iterations_s, "overhead_ms": 1e3 * timing.host_s_per_step})
                log.info(f"real {p} @ {rate:g} req/s (pass {rep + 1}): "
                         f"{summarize(runs[-1]['records'], duration=cfg.duration)['slo_attainment']:.1%} attainment")
    return {"info": info | {"real_wall_s": time.perf_counter() - t_start}, "items": items, "runs": runs,
            "profile": bench.profile.to_json(),
            "prior": {str(t): v for t, v in bench.threshold_config(budget, "adaptive").prior},
            "eval_rows": bench.rows,
            "batch_buckets": list(bench.runner.decoder.config.batch_buckets),
            "length_buckets": sorted(set(bench.lengths.values()))}


def contention_timeline(run_: dict, step_time) -> tuple[tuple[float, float], ...]:
    """The run's measured slowdown over time: each real step's duration over its modelled one, at the
    step's start (seconds from the run's start)."""
    start = run_["records"][0]["arrival"] - run_["trace"][0][0]  # the first arrival is start + its offset
    rng = np.random.default_rng(0)
    base = dataclasses.replace(step_time, noise=0.0, overhead_s=0.0, timeline=())
    out = [(t0 - start, (t1 - t0) / pred) for kind, shapes, t0, t1 in run_["steps"]
           if (pred := base.batch_seconds(kind, shapes, 1, rng)) > 0]
    return tuple(sorted(out))


def compare_with_sim(measured: dict, seeds: int, source: str = "run", noise: str = "timeline") -> dict:
    """The simulated side, fed only `measured`, side by side with the real runs. noise "timeline": each
    run's own measured slowdown over time is replayed; "iid": the pooled spread is resampled."""
    info, duration = measured["info"], measured["info"]["duration"]
    step_time, latency, spread = step_time_model(measured, source)
    spread["noise"] = noise
    prior = {float(t): v for t, v in measured["prior"].items()} or None
    rows = []
    t_sim = time.perf_counter()
    for run_ in measured["runs"]:
        real = summarize(run_["records"], duration=duration)
        st = step_time
        if noise == "timeline":
            st = dataclasses.replace(step_time, timeline=contention_timeline(run_, step_time))
        elif noise != "iid":
            raise ValueError(f"noise must be timeline or iid, got {noise!r}")
        sims = simulate(info, run_["policy"], run_["trace"], measured["items"], step_time=st, latency=latency,
                        prior=prior, seeds=seeds, eval_rows=measured.get("eval_rows"))
        sim = _mean_rows(sims, duration)
        rows.append({"policy": run_["policy"], "rate": run_["rate"], "load": run_["load"],
                     "repeat": run_.get("repeat", 0), "real": real, "sim": sim, "compare": compare(real, sim)})
    rows.sort(key=lambda r: (r["rate"], r["policy"], r["repeat"]))
    return {"info": info | {"step_time": spread, "sim_wall_s": time.perf_counter() - t_sim}, "rows": rows}


def run(cfg: ValidateConfig) -> dict:
    if cfg.from_file:
        measured = json.loads(Path(cfg.from_file).read_text())
        log.info(f"real runs from {cfg.from_file} ({len(measured['runs'])} runs)")
    else:
        measured = measure_real(cfg)
        if cfg.out:
            d = Path(cfg.out)
            d.mkdir(parents=True, exist_ok=True)
            (d / "measured.json").write_text(json.dumps(measured, default=float))
            Profile.from_json(measured["profile"]).save(d / "profile.json")
            log.info(f"wrote {d / 'measured.json'} (re-simulate with --from) and {d / 'profile.json'}")
    out = compare_with_sim(measured, cfg.sim_seeds, cfg.step_source, cfg.noise)
    sp = out["info"]["step_time"]
    log.info(f"step time ({sp['source']}): actual/modelled median {sp['ratio_median']:.3f}, mean "
             f"{sp['ratio_mean']:.3f} (p10 {sp['ratio_p10']:.3f}, p90 {sp['ratio_p90']:.3f}) over {sp['steps']} steps; "
             f"host time per step {sp['overhead_per_step_ms']:.2f} ms")
    if cfg.out:
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        (Path(cfg.out) / f"validate_{cfg.step_source}_{cfg.noise}.json").write_text(
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
        print(format_rows(out["rows"]))
        spread = real_repeatability(out["rows"])
        if spread:
            print("the real server against itself (same trace, another pass): " + "; ".join(
                f"{p} @ {rate:g}: {d_att:+.1f} pts, {100 * d_lat:+.0f}%" for (p, rate), (d_att, d_lat) in spread.items()))
        ok = sum(r["compare"]["within"] for r in out["rows"])
        print(f"{ok}/{len(out['rows'])} points within the targets (attainment ±{TARGET_POINTS:g} points, mean latency "
              f"±{100 * TARGET_LATENCY:.0f}%); real side {out['info']['real_wall_s']:.0f} s, simulator "
              f"{out['info']['sim_wall_s']:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
