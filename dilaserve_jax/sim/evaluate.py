"""`python -m dilaserve_jax.sim.evaluate`: the paper's comparison in simulation, and its scaling.

On `--devices` (8) modelled H100s with the analytic LLaDA-8B profile, for each workload (the Azure
code trace time-scaled, and Poisson arrivals with the trace's lengths) and each request rate:

  fcfs-static on fixed 1x8, 2x4 and 8x1, and edf-static on the same layouts (τ 0.9);
  dilaserve with --layout auto (adaptive τ, load control, reconfiguration, migration);
  dilaserve without each of: threshold adaptation, load control, reconfiguration, migration.

It prints one table per workload, the paper's headline comparison (at the lowest rate where the
best static system attains <= 50%: our attainment gain and mean-latency change, and the accuracy
change), draws attainment / mean latency / accuracy against rate, then repeats dilaserve and the
static layouts at 16, 32 and 64 devices with the rate scaled with the devices, timing each run.
Points run in `--jobs` processes; every simulation is deterministic per seed.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dilaserve_jax.core.cli import add_config_arguments, config_from_args, opt, returns_exit_status, setup_logging
from dilaserve_jax.sim.report import format_table, headline, plot_rates

log = logging.getLogger(__name__)

PAPER = {"attainment_gain_points": 56.6, "latency_reduction": 0.46, "accuracy_drop_points": 1.0}
ABLATIONS = ("threshold", "load", "reconfig", "migration")


def systems(devices: int) -> list[tuple[str, str, str]]:
    """(policy, layout, ablations) of every compared system on `devices` devices."""
    wide, half = f"{devices // 8}x8", f"{devices // 4}x4"
    static = [(p, lay, "") for p in ("fcfs-static", "edf-static") for lay in (wide, half, f"{devices}x1")]
    return static + [("dilaserve", "auto", "")] + [("dilaserve", "auto", a) for a in ABLATIONS]


def name_of(policy: str, layout: str, ablate: str) -> str:
    return f"{policy} {layout}" + "".join(f" -{a}" for a in ablate.split(",") if a)


def _point(job: dict) -> dict:
    """One simulation (runs in a worker process)."""
    from dilaserve_jax.sim.__main__ import build_parser, configs, run

    argv = ["--trace", job["trace"], "--devices", str(job["devices"]), "--policy", job["policy"], "--layout",
            job["layout"], "--rate-scale", str(job["rate_scale"]), "--duration", str(job["duration"]), "--seed",
            str(job["seed"]), "--no-progress"]
    if job.get("lengths"):
        argv += ["--lengths", job["lengths"]]
    if job["ablate"]:
        argv += ["--ablate", job["ablate"]]
    parser = build_parser()
    t0 = time.process_time()
    row, res = run(*configs(parser, parser.parse_args(argv)))
    row.update({"system": name_of(job["policy"], job["layout"], job["ablate"]), "workload": job["workload"],
                "rate": job["rate"], "cpu_s": time.process_time() - t0, "duration": job["duration"],
                "layouts": res.layouts[:20], "ablate": job["ablate"], "policy": job["policy"]})
    return row


@dataclass(frozen=True, slots=True)
class EvaluateConfig:
    trace: str = opt(help="the Azure code trace CSV (e.g. ../shared/traces/azure_llm_2023_code.csv)")
    devices: int = opt(8, "devices of the main comparison")
    poisson_rates: tuple[float, ...] = opt((20, 40, 60, 80, 100, 120), "Poisson rates in req/s")
    trace_scales: tuple[float, ...] = opt((8, 16, 24, 32, 40, 48), "rate scales of the code trace (2.57 req/s native)")
    duration: float = opt(60.0, "seconds of arrivals per point")
    scale_devices: tuple[int, ...] = opt((16, 32, 64), "device counts of the scaling runs (none to skip)", nargs="*")
    scale_rate: float = opt(60.0, "Poisson rate per 8 devices in the scaling runs")
    scale_duration: float = opt(30.0, "seconds of arrivals per scaling run")
    workloads: tuple[str, ...] = opt(("code", "poisson"), "workloads to compare on", choices=("code", "poisson"))
    seed: int = opt(0, "seed")
    jobs: int = opt(2, "worker processes")
    out: str | None = opt(None, "write evaluate.json and the plots here", metavar="DIR")
    resume: str | None = opt(None, "an earlier evaluate.json: its points (same workload, devices, system and rate) "
                                   "are reused, not run again (it must come from the same --duration, "
                                   "--scale-duration and --seed)", metavar="JSON")
    progress: bool = opt(True, "progress bar on stderr")

    def __post_init__(self):
        if not Path(self.trace).is_file():
            raise ValueError(f"trace {self.trace} not found")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dilaserve_jax.sim.evaluate",
        description="The paper's evaluation in simulation: static systems, dilaserve and its ablations on 8 modelled "
                    "H100s (analytic LLaDA-8B), code trace and Poisson, across rates; then 16-64 devices.")
    return add_config_arguments(p, EvaluateConfig)


def _key(r: dict) -> tuple:
    return r["workload"], r["devices"], r["system"], round(float(r["rate"]), 6)


def _jobs(args) -> list[dict]:
    out = []
    for workload in args.workloads:
        points = ([(r, f"poisson:{r}", 1.0) for r in args.poisson_rates] if workload == "poisson"
                  else [(round(2.5667 * s, 2), args.trace, s) for s in args.trace_scales])
        for rate, trace, scale in points:
            for policy, layout, ablate in systems(args.devices):
                out.append({"workload": workload, "rate": rate, "trace": trace, "rate_scale": scale,
                            "lengths": args.trace if workload == "poisson" else None, "devices": args.devices,
                            "policy": policy, "layout": layout, "ablate": ablate, "duration": args.duration,
                            "seed": args.seed, "part": "main"})
    for n in args.scale_devices:
        rate = args.scale_rate * n / 8
        for policy, layout, ablate in systems(n)[:3] + [("dilaserve", "auto", "")]:
            out.append({"workload": "poisson", "rate": rate, "trace": f"poisson:{rate}", "rate_scale": 1.0,
                        "lengths": args.trace, "devices": n, "policy": policy, "layout": layout, "ablate": ablate,
                        "duration": args.scale_duration, "seed": args.seed, "part": "scale"})
    return out


@returns_exit_status
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = config_from_args(EvaluateConfig, parser.parse_args(argv), parser)
    setup_logging(log)
    jobs = _jobs(args)
    rows = []
    if args.resume:
        done = {_key(r): r for r in json.loads(Path(args.resume).read_text())["rows"]}
        wanted = {_key({**j, "system": name_of(j["policy"], j["layout"], j["ablate"])}) for j in jobs}
        rows = [r for k, r in done.items() if k in wanted]
        jobs = [j for j in jobs if _key({**j, "system": name_of(j["policy"], j["layout"], j["ablate"])}) not in done]
        log.info(f"{len(rows)} points reused from {args.resume}")
    log.info(f"{len(jobs)} simulations on {args.jobs} processes")
    t0 = time.perf_counter()
    bar = None
    if args.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(jobs), desc="simulations", unit="run", file=sys.stderr)
    # the expensive ones (dilaserve at the highest rates, many devices) first, so the pool ends together
    order = sorted(jobs, key=lambda j: (-j["devices"], j["policy"] != "dilaserve", -j["rate"]))
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for row in pool.map(_point, order):
            rows.append(row)
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"{row['system']} @ {row['rate']:g}")
    if bar is not None:
        bar.close()
    wall = time.perf_counter() - t0
    out = {"rows": rows, "wall_s": wall, "paper": PAPER, "headlines": {}}
    statics = [name_of(*s) for s in systems(args.devices)[:6]]
    for workload in args.workloads:
        main_rows = sorted((r for r in rows if r["workload"] == workload and r["devices"] == args.devices),
                           key=lambda r: (r["rate"], r["system"]))
        print(f"\n== {workload} ({args.devices} devices, {args.duration:g} s of arrivals per point) ==")
        print(format_table(main_rows))
        h = headline(main_rows, "dilaserve auto", statics)
        out["headlines"][workload] = h
        print(_headline_text(h))
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            plot_rates(main_rows, str(Path(args.out) / f"sim_{workload}.png"),
                       f"{workload}: {args.devices} modelled H100s, analytic LLaDA-8B profile")
    scale = sorted((r for r in rows if r["devices"] != args.devices), key=lambda r: (r["devices"], r["system"]))
    if scale:
        print("\n== scaling (Poisson, rate per 8 devices "
              f"{args.scale_rate:g} req/s; wall and CPU seconds of each simulation) ==")
        for r in scale:
            print(f"{r['devices']:>3} devices {r['system']:<22} {r['rate']:>6.0f} req/s {r['requests']:>6} req  "
                  f"SLO {100 * r['slo_attainment']:5.1f}%  mean {r['mean_latency']:.2f} s  "
                  f"wall {r['wall_s']:6.1f} s  cpu {r['cpu_s']:6.1f} s")
    print(f"\n{len(rows)} points, {len(jobs)} simulated now in {wall:.0f} s wall")
    if args.out:
        (Path(args.out) / "evaluate.json").write_text(json.dumps(out, indent=1, default=str))
        log.info(f"wrote {args.out}/evaluate.json and the plots")
    return 0


def _headline_text(h: dict | None) -> str:
    if h is None:
        return "the best static system attains > 50% at every rate: no overload point to compare at"
    return (f"at {h['rate']:g} req/s (best static: {h['best_static']} at {100 * h['static_attainment']:.1f}%): dilaserve "
            f"auto {h['gain_points']:+.1f} points SLO attainment (paper +{PAPER['attainment_gain_points']}), mean "
            f"latency {100 * h['latency_change']:+.0f}% (paper -{100 * PAPER['latency_reduction']:.0f}%), accuracy "
            f"{h['accuracy_change_points']:+.1f} points graded, expected drop vs τ_max on the same requests "
            f"{h.get('accuracy_drop_points', float('nan')):.2f} points (paper: < {PAPER['accuracy_drop_points']:g} point drop)")


if __name__ == "__main__":
    raise SystemExit(main())
