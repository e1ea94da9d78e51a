"""`python -m dilaserve_jax.sim.evaluate_changing`: issue 29's changing loads, auto against every static system.

Three workloads on `--devices` (8) modelled H100s (analytic LLaDA-8B), code-trace lengths:

  diurnal  Poisson at 55·(1 + 0.818·sin(2πt/1200 s)) req/s: 55 → 100 → 10 → 55 over 20 minutes
           (`diurnal:55:1200:0.818`);
  step     Poisson at 20, then 90, then 20 req/s, 5 minutes each (`steps:20@300,90@300,20@300`);
  trace    the Azure code trace's own timestamps sped up `--trace-speed` (15) times, about 38 req/s with
           bursts past capacity, repeated to fill 15 minutes.

Each runs twice: `--slo-tp 1` (SLOs relative to a TP-1 instance's idle latency, the default) and
`--slo-tp 8` (tight: relative to the widest instance). The systems: `dilaserve --layout auto` with
default flags, and the static ones: fcfs-static, edf-static and dilaserve on each fixed layout
(8x1, 4x2, 2x4, 1x8 on 8 devices). Per workload and SLO it prints the table (attainment, mean
latency) and the issue's verdicts:

  --slo-tp 8: auto beats every static system by at least `TIGHT_MARGIN` (10) points of attainment;
  --slo-tp 1: no static system dominates auto: each one is at least `WORSE_POINTS` (5) points worse
              in attainment or at least `SLOWER` (20%) slower in mean latency.

`--time-scale X` compresses every timeline (the diurnal period, the step lengths and each
workload's duration) by X, rates unchanged, for short versions (the controller's own window,
dwell and interval are not scaled). Points run in `--jobs` processes; the JSON in `--out` is
rewritten after every point, so `--resume` picks up an interrupted run.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from dilaserve_jax.core.cli import add_config_arguments, config_from_args, opt, returns_exit_status, setup_logging

log = logging.getLogger(__name__)

AUTO = "dilaserve auto"
TIGHT_MARGIN = 10.0  # points: with --slo-tp 8 auto must beat every static system by this much
WORSE_POINTS = 5.0  # points: with --slo-tp 1 a static system is not dominating if this much worse ...
SLOWER = 0.20  # ... or this much slower in mean latency
WORKLOADS = ("diurnal", "step", "trace")


def workload_args(name: str, *, trace: str, time_scale: float, trace_speed: float) -> dict:
    """The sim flags of one changing-load workload at a time scale (timelines times `time_scale`)."""
    s = time_scale
    if name == "diurnal":
        return {"trace": f"diurnal:55:{1200 * s:g}:0.818", "duration": 1200 * s, "lengths": trace, "rate_scale": 1.0}
    if name == "step":
        return {"trace": f"steps:20@{300 * s:g},90@{300 * s:g},20@{300 * s:g}", "duration": 900 * s,
                "lengths": trace, "rate_scale": 1.0}
    if name == "trace":
        return {"trace": trace, "duration": 900 * s, "lengths": None, "rate_scale": trace_speed}
    raise ValueError(f"unknown changing-load workload {name!r}; choose from {', '.join(WORKLOADS)}")


def systems(devices: int) -> list[tuple[str, str]]:
    """(policy, layout): the static systems on each fixed layout, then dilaserve auto."""
    layouts = [f"{devices // tp}x{tp}" for tp in (1, 2, 4, 8) if devices % tp == 0]
    return [(p, lay) for p in ("fcfs-static", "edf-static", "dilaserve") for lay in layouts] + [("dilaserve", "auto")]


def _point(job: dict) -> dict:
    """One simulation (runs in a worker process)."""
    from dilaserve_jax.sim.__main__ import build_parser, configs, run

    argv = ["--trace", job["trace"], "--devices", str(job["devices"]), "--policy", job["policy"], "--layout",
            job["layout"], "--rate-scale", str(job["rate_scale"]), "--duration", str(job["duration"]), "--seed",
            str(job["seed"]), "--slo-tp", str(job["slo_tp"]), "--no-progress"]
    if job.get("lengths"):
        argv += ["--lengths", job["lengths"]]
    parser = build_parser()
    t0 = time.process_time()
    row, res = run(*configs(parser, parser.parse_args(argv)))
    row.update({"system": f"{job['policy']} {job['layout']}", "workload": job["workload"], "slo_tp": job["slo_tp"],
                "seed": job["seed"],
                "cpu_s": time.process_time() - t0, "duration": job["duration"], "time_scale": job["time_scale"],
                "layouts": res.layouts[:40], "switches": len(res.layouts) - 1})
    return row


def _key(r: Mapping) -> tuple:
    return (r["workload"], int(r["slo_tp"]), r["devices"], r["system"], round(float(r["time_scale"]), 6),
            int(r.get("seed", 0)))


# --- verdicts (pure: on rows with system, slo_attainment, mean_latency) ---
def tight_verdict(rows: Sequence[Mapping], ours: str = AUTO, margin: float = TIGHT_MARGIN) -> dict:
    """--slo-tp 8: does `ours` beat every other system by >= `margin` points of attainment?"""
    auto = _one(rows, ours)
    others = [r for r in rows if r["system"] != ours]
    if auto is None or not others:
        return {"ok": None, "reason": "missing rows"}
    best = max(others, key=lambda r: r["slo_attainment"])
    gap = 100 * (auto["slo_attainment"] - best["slo_attainment"])
    short = [r["system"] for r in others if 100 * (auto["slo_attainment"] - r["slo_attainment"]) < margin]
    return {"ok": not short, "gap_points": gap, "best_static": best["system"], "not_beaten": short,
            "reason": (f"auto {100 * auto['slo_attainment']:.1f}% vs best static {best['system']} "
                       f"{100 * best['slo_attainment']:.1f}%: {gap:+.1f} points (need >= +{margin:g})")}


def dominates(static: Mapping, auto: Mapping, worse_points: float = WORSE_POINTS, slower: float = SLOWER) -> bool:
    """A static system dominates auto unless it is >= `worse_points` points worse in attainment or
    >= `slower` slower in mean latency (a run with no completed request has infinite latency)."""
    worse = 100 * (auto["slo_attainment"] - static["slo_attainment"]) >= worse_points - 1e-9
    lat_s, lat_a = _lat(static), _lat(auto)
    slow = lat_s >= (1 + slower) * lat_a - 1e-12 if math.isfinite(lat_a) else False
    return not (worse or slow)


def relative_verdict(rows: Sequence[Mapping], ours: str = AUTO) -> dict:
    """--slo-tp 1: is `ours` dominated by no other system?"""
    auto = _one(rows, ours)
    others = [r for r in rows if r["system"] != ours]
    if auto is None or not others:
        return {"ok": None, "reason": "missing rows"}
    dom = [r["system"] for r in others if dominates(r, auto)]
    detail = ", ".join(f"{r['system']} ({100 * r['slo_attainment']:.1f}%, {_lat(r):.2f} s)"
                       for r in others if r["system"] in dom)
    return {"ok": not dom, "dominated_by": dom,
            "reason": (f"auto {100 * auto['slo_attainment']:.1f}%, {_lat(auto):.2f} s; "
                       + (f"dominated by {detail}" if dom else
                          f"every static system is >= {WORSE_POINTS:g} points worse or >= {100 * SLOWER:.0f}% slower"))}


def verdict(rows: Sequence[Mapping], slo_tp: int) -> dict:
    """The issue's target for this SLO reference: tight (TP >= 8) or relative (TP 1)."""
    return tight_verdict(rows) if slo_tp >= 8 else relative_verdict(rows)


def _one(rows, system):
    return next((r for r in rows if r["system"] == system), None)


def _lat(r: Mapping) -> float:
    x = r.get("mean_latency", math.nan)
    return math.inf if x is None or not math.isfinite(x) else float(x)


# --- the command ---
@dataclass(frozen=True, slots=True)
class ChangingConfig:
    trace: str = opt(help="the Azure code trace CSV (e.g. ../shared/traces/azure_llm_2023_code.csv): the lengths of "
                          "every workload and the arrivals of the trace workload")
    workloads: tuple[str, ...] = opt(WORKLOADS, "workloads to run", choices=WORKLOADS, nargs="*")
    slo_tps: tuple[int, ...] = opt((1, 8), "--slo-tp values to run each workload with", nargs="*")
    time_scale: float = opt(1.0, "compress every timeline (diurnal period, step lengths, durations) by this factor")
    trace_speed: float = opt(15.0, "rate scale of the code trace (2.57 req/s native; 15: ~38 req/s, bursts past "
                                   "capacity)")
    devices: int = opt(8, "devices")
    seed: int = opt(0, "seed")
    jobs: int = opt(1, "worker processes")
    out: str | None = opt(None, "write changing.json here (after every point)", metavar="DIR")
    resume: str | None = opt(None, "an earlier changing.json: its points (same workload, SLO, devices, system, time "
                                   "scale and seed) are reused", metavar="JSON")
    progress: bool = opt(True, "progress bar on stderr")

    def __post_init__(self):
        if not Path(self.trace).is_file():
            raise ValueError(f"trace {self.trace} not found")
        if not self.time_scale > 0 or not self.trace_speed > 0:
            raise ValueError("--time-scale and --trace-speed must be positive")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dilaserve_jax.sim.evaluate_changing",
                                description="Changing loads (diurnal, step, sped-up code trace) with --slo-tp 1 and 8: "
                                            "dilaserve --layout auto against fcfs-static, edf-static and dilaserve on "
                                            "every fixed layout, with the issue's verdicts.")
    return add_config_arguments(p, ChangingConfig)


def jobs_of(args: ChangingConfig) -> list[dict]:
    out = []
    for workload in args.workloads:
        w = workload_args(workload, trace=args.trace, time_scale=args.time_scale, trace_speed=args.trace_speed)
        for slo_tp in args.slo_tps:
            for policy, layout in systems(args.devices):
                out.append({**w, "workload": workload, "slo_tp": slo_tp, "devices": args.devices, "policy": policy,
                            "layout": layout, "seed": args.seed, "time_scale": args.time_scale})
    return out


def report(rows: Sequence[Mapping], args: ChangingConfig) -> dict:
    verdicts = {}
    for workload in args.workloads:
        w = workload_args(workload, trace=args.trace, time_scale=args.time_scale, trace_speed=args.trace_speed)
        for slo_tp in args.slo_tps:
            rs = sorted((r for r in rows if r["workload"] == workload and int(r["slo_tp"]) == slo_tp),
                        key=lambda r: (r["system"] == AUTO, r["system"]))
            if not rs:
                continue
            print(f"\n== {workload}: {w['trace'] if workload != 'trace' else 'code trace x' + str(args.trace_speed)}, "
                  f"{w['duration']:g} s (time scale {args.time_scale:g}), --slo-tp {slo_tp}, {args.devices} devices ==")
            print(f"{'system':<24}{'SLO %':>7}{'mean s':>8}{'p99 s':>8}{'n':>7}{'switches':>9}  layouts")
            for r in rs:
                lays = " -> ".join(dict.fromkeys(l for _, l in r.get("layouts", [])))  # noqa: E741
                print(f"{r['system']:<24}{100 * r['slo_attainment']:7.1f}{_lat(r):8.2f}{r['p99_latency']:8.2f}"
                      f"{r['requests']:7d}{r.get('switches', 0):9d}  {lays if r['system'] == AUTO else ''}")
            v = verdict(rs, slo_tp)
            verdicts[f"{workload} slo-tp {slo_tp}"] = v
            target = (f"beat every static system by >= {TIGHT_MARGIN:g} points" if slo_tp >= 8
                      else "dominated by no static system")
            print(f"verdict ({target}): {'PASS' if v['ok'] else 'FAIL' if v['ok'] is False else 'n/a'}: {v['reason']}")
    return verdicts


@returns_exit_status
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = config_from_args(ChangingConfig, parser.parse_args(argv), parser)
    setup_logging(log)
    jobs = jobs_of(args)
    rows: list[dict] = []
    other: list[dict] = []  # points of the resumed file this run does not ask for: kept in its output
    wanted = {_key({**j, "system": f"{j['policy']} {j['layout']}"}) for j in jobs}
    if args.resume and Path(args.resume).is_file():
        done = {_key(r): r for r in json.loads(Path(args.resume).read_text())["rows"]}
        rows = [r for k, r in done.items() if k in wanted]
        other = [r for k, r in done.items() if k not in wanted]
        jobs = [j for j in jobs if _key({**j, "system": f"{j['policy']} {j['layout']}"}) not in done]
        log.info(f"{len(rows)} points reused from {args.resume}")
    log.info(f"{len(jobs)} simulations on {args.jobs} processes")
    out_path = Path(args.out) / "changing.json" if args.out else None
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    bar = None
    if args.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(jobs), desc="simulations", unit="run", file=sys.stderr)
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for row in pool.map(_point, jobs):
            rows.append(row)
            log.info(f"{row['workload']} slo-tp {row['slo_tp']} {row['system']}: {100 * row['slo_attainment']:.1f}% "
                     f"SLO, mean {row['mean_latency']:.2f} s ({row['wall_s']:.0f} s wall; "
                     f"{time.perf_counter() - t0:.0f} s so far)")
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"{row['workload']} tp{row['slo_tp']} {row['system']}")
            if out_path is not None:
                out_path.write_text(json.dumps({"rows": rows + other}, indent=1, default=str))
    if bar is not None:
        bar.close()
    verdicts = report(rows, args)
    print(f"\n{len(rows)} points, {len(jobs)} simulated now in {time.perf_counter() - t0:.0f} s wall")
    if out_path is not None:
        out_path.write_text(json.dumps({"rows": rows + other, "verdicts": verdicts, "time_scale": args.time_scale},
                                       indent=1, default=str))
        log.info(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
