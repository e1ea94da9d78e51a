"""`python -m dilaserve_jax.sim.calibrate`: are the cluster controller's predictions right?

For each load on a grid and each candidate layout, the controller predicts SLO attainment, mean
latency and mean τ from what it sees (the arrival rate and a sample of recent request shapes over
its window). The simulator then runs that layout held fixed, under the same per-instance policy
(dilaserve: adaptive τ, load control, migration; no reshaping), on the same arrivals, and measures
the same three figures. The table puts them side by side; per load it also says whether the
layout the controller ranks first is within `--rank-tolerance` points of the simulated best.

The prediction is what the controller would say in steady state: the mean of its predictions at
the end of each full window of arrivals, each from that window alone.
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

import numpy as np

from dilaserve_jax.core.cli import add_config_arguments, config_from_args, opt, returns_exit_status, setup_logging
from dilaserve_jax.core.layouts import layout_text, parse_layout

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CalibrateConfig:
    lengths: str | None = opt(None, "draw prompt/answer lengths from this trace CSV (e.g. "
                                    "../shared/traces/azure_llm_2023_code.csv)", metavar="CSV",
                              default_text="fixed lengths")
    rates: tuple[float, ...] = opt((10, 30, 50, 70, 90, 110), "Poisson arrival rates in req/s")
    layouts: tuple[str, ...] = opt((), "candidate layouts", default_text="1xN, 2x(N/2), ..., Nx1 of the devices",
                                   nargs="*")
    devices: int = opt(8, "modelled devices")
    model: str = opt("llada_8b", "modelled model")
    profile: str | None = opt(None, "latency profile (as for python -m dilaserve_jax.sim)", default_text="h100")
    slo: str = opt("idle:2,6", "per-request SLO (as for python -m dilaserve_jax.sim)")
    slo_tp: int = opt(1, "TP degree of the instance idle latencies refer to")
    duration: float = opt(60.0, "seconds of arrivals per point")
    seeds: tuple[int, ...] = opt((0,), "workload seeds (figures are their mean)")
    jobs: int = opt(2, "worker processes")
    tolerance: float = opt(10.0, "target: |predicted - simulated| attainment, in points")
    rank_tolerance: float = opt(3.0, "target: the layout ranked first is within this many points of the simulated "
                                     "best")
    price_answer_ends: bool = opt(False, "the controller prices each request's last block at the share answers decode "
                                         "(as python -m dilaserve_jax.sim --price-answer-ends)")
    latency_at_answer_ends: bool = opt(False, "the controller prices the mean latency where answers end (as python -m "
                                              "dilaserve_jax.sim --latency-at-answer-ends)")
    latency_rate_margin: float | None = opt(None, "the margin past the rate at which the controller's decision reads "
                                                  "mean latency (as python -m dilaserve_jax.sim --latency-rate-margin; "
                                                  "the table's predicted latency is at the rate itself)",
                                            default_text="the controller's default")
    json: bool = opt(False, "print the rows as JSON")
    plot: str | None = opt(None, "draw predicted against simulated attainment per layout", metavar="PNG")
    progress: bool = opt(True, "progress bar on stderr")

    def __post_init__(self):
        if self.lengths is not None and not Path(self.lengths).is_file():
            raise ValueError(f"--lengths {self.lengths} not found")
        if not self.rates or min(self.rates) <= 0:
            raise ValueError("--rates must be positive")
        if self.duration <= 0 or self.jobs < 1 or not self.seeds:
            raise ValueError("--duration must be positive, --jobs >= 1, at least one seed")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dilaserve_jax.sim.calibrate",
        description="Compare the cluster controller's predicted SLO attainment, mean latency and τ of each candidate "
                    "layout with what the simulator measures when that layout is held fixed, over a grid of Poisson "
                    "loads. Prints the table, the worst errors and whether the controller's first choice is within "
                    "the tolerance of the simulated best.")
    return add_config_arguments(p, CalibrateConfig)


def default_layouts(devices: int) -> list[str]:
    out, tp = [], 1
    while tp <= devices:
        out.append(f"{devices // tp}x{tp}")
        tp *= 2
    return out


def _sim_argv(cfg: CalibrateConfig, rate: float, seed: int, layout: str) -> list[str]:
    argv = ["--trace", f"poisson:{rate:g}", "--duration", str(cfg.duration), "--seed", str(seed), "--devices",
            str(cfg.devices), "--model", cfg.model, "--slo", cfg.slo, "--slo-tp", str(cfg.slo_tp), "--policy",
            "dilaserve", "--layout", layout, "--no-progress"]
    if cfg.lengths:
        argv += ["--lengths", cfg.lengths]
    if cfg.profile:
        argv += ["--profile", cfg.profile]
    if cfg.price_answer_ends:
        argv.append("--price-answer-ends")
    if cfg.latency_at_answer_ends:
        argv.append("--latency-at-answer-ends")
    if cfg.latency_rate_margin is not None:
        argv += ["--latency-rate-margin", str(cfg.latency_rate_margin)]
    return argv


def predict_point(cfg: CalibrateConfig, rate: float, seed: int, layouts: list[str]) -> dict[str, tuple]:
    """Layout -> the controller's mean predicted (attainment, latency s, τ, the latency its decision weighs)
    over the run's full windows (the last: with `latency_rate_margin`, read past the rate)."""
    from dilaserve_jax.sim.__main__ import build_parser as sim_parser, configs, make_specs
    from dilaserve_jax.serving.policy.answer_fill import LastBlockFill
    from dilaserve_jax.sim.setup import setup_model
    from dilaserve_jax.sim.simulator import Simulation, _shape

    parser = sim_parser()
    sim_cfg, workload, command = configs(parser, parser.parse_args(_sim_argv(cfg, rate, seed, "auto")))
    m = setup_model(command.model, command.profile, eval_rows=command.eval_rows, seed=workload.seed,
                    tp_degrees=sim_cfg.tp_degrees, slots=sim_cfg.slots, length_buckets=command.buckets)
    specs = make_specs(workload, m, model=command.model, tau=sim_cfg.static_tau, slo_tp=command.slo_tp)
    sim = Simulation(sim_cfg, specs, step_time=m.step_time, latency=m.latency, quality=m.quality, prior=m.prior,
                     param_bytes=m.param_bytes, progress=False, eval_rows=m.eval_rows)
    cands = [parse_layout(x) for x in layouts]
    window = sim_cfg.controller.window_s
    ends = np.arange(window, cfg.duration + 1e-9, window)
    if not len(ends):  # shorter than one window: the whole run, as the controller would see it
        ends = np.array([cfg.duration])
    preds: dict[str, list[tuple]] = {layout_text(c): [] for c in cands}
    for end in ends:
        ctl = sim._controller(cands)
        fill = LastBlockFill()  # what the instances would publish as the window's requests finish
        window_specs = [s for s in specs if end - window <= s.arrival < end]
        for s in window_specs:
            ctl.observe(_shape(s, sim_cfg), s.arrival)
            fill.observe(s.finish_tokens or s.answer_length, s.answer_length, s.block_length)
        ctl.set_last_block_fill(fill.mean)
        if m.quality is not None and window_specs:
            ctl.set_tokens_per_step(ctl.taus, published_rates(m.quality, window_specs, ctl.taus), smooth=False)
        rate_seen, sample = ctl.load(float(end))
        if not sample:
            continue
        spread, curves = ctl.spread(float(end), sample), ctl._curves(sample, cands)  # the chains once for both
        plain = ctl.predict(rate_seen, sample, cands, curves, spread=spread, latency_margin=0.0)
        weighed = ctl.predict(rate_seen, sample, cands, curves, spread=spread) if ctl.cfg.latency_rate_margin else plain
        for p, w in zip(plain, weighed):
            preds[layout_text(p.layout)].append((p.attainment, p.latency_s, p.tau, w.latency_s))
    return {k: tuple(float(np.mean([v[i] for v in vals])) for i in range(4)) for k, vals in preds.items() if vals}


def published_rates(quality, specs, taus, limit: int = 128) -> list[float]:
    """τ -> tokens per step as the instances' online estimate settles on it for these requests: the
    mean commits of the steps that end neither a block nor the request (`TokensPerStep.observe`
    skips those), each request run alone at a constant τ, over up to `limit` of them spread over
    the list. The table's own rate overstates it: a request's steps per block are a ceiling of its
    positions over a rate drawn per request and block, so the table was 10-18% optimistic."""
    from dilaserve_jax.sim.executor import advance
    from dilaserve_jax.sim.quality import Progress, make_plan

    picked = specs[:: max(1, len(specs) // limit)]
    plans = [make_plan(quality, 1_000_003 + i, s.task, s.answer_length, s.block_length, s.finish_tokens,
                       s.prompt_tokens) for i, s in enumerate(picked)]
    out = []
    for tau in taus:
        total = steps = 0
        for plan in plans:
            prog, finished = Progress(), False
            while not finished:
                _, n, block_done, finished = advance(quality, plan, prog, tau)
                if not (block_done or finished):
                    total, steps = total + n, steps + 1
        out.append(total / steps if steps else quality.tokens_per_step(picked[0].task, tau))
    return out


def _job(job: dict) -> dict:
    """One point: the prediction (layout "predict") or one fixed-layout simulation (runs in a worker)."""
    cfg: CalibrateConfig = job["cfg"]
    t0 = time.perf_counter()
    if job["layout"] == "predict":
        return {**_meta(job), "predicted": predict_point(cfg, job["rate"], job["seed"], job["layouts"]),
                "wall_s": time.perf_counter() - t0}
    from dilaserve_jax.sim.__main__ import build_parser as sim_parser, configs, run

    parser = sim_parser()
    row, _ = run(*configs(parser, parser.parse_args(_sim_argv(cfg, job["rate"], job["seed"], job["layout"]))))
    return {**_meta(job), "simulated": (row["slo_attainment"], row["mean_latency"], row["mean_tau"]),
            "wall_s": time.perf_counter() - t0}


def _meta(job: dict) -> dict:
    return {"rate": job["rate"], "seed": job["seed"], "layout": job["layout"]}


def collect(cfg: CalibrateConfig, results: list[dict], layouts: list[str]) -> list[dict]:
    """One row per (rate, layout): predicted and simulated figures, seed means."""
    rows = []
    for rate in cfg.rates:
        at_rate = [r for r in results if r["rate"] == rate]
        preds = [r["predicted"] for r in at_rate if "predicted" in r]
        for lay in layouts:
            sims = [r["simulated"] for r in at_rate if r["layout"] == lay and "simulated" in r]
            pv = [p[lay] for p in preds if lay in p]
            if not sims or not pv:
                continue
            p, s = np.mean(pv, axis=0), np.mean(np.nan_to_num(np.asarray(sims, dtype=float), nan=0.0), axis=0)
            rows.append({"rate": rate, "layout": lay, "pred_attainment": float(p[0]), "pred_latency": float(p[1]),
                         "pred_tau": float(p[2]), "weighed_latency": float(p[3]), "sim_attainment": float(s[0]),
                         "sim_latency": float(s[1]), "sim_tau": float(s[2]), "error_points": 100 * float(p[0] - s[0])})
    return rows


def ranking(cfg: CalibrateConfig, rows: list[dict]) -> list[dict]:
    """Per rate: the controller's first choice (its own objective) against the simulated best."""
    from dilaserve_jax.serving.policy.controller import ControllerConfig

    ccfg = ControllerConfig()
    out = []
    for rate in cfg.rates:
        at = [r for r in rows if r["rate"] == rate]
        if not at:
            continue
        ref = min(r["weighed_latency"] for r in at)
        first = max(at, key=lambda r: ccfg.value(r["pred_attainment"], r["pred_tau"], r["weighed_latency"], ref))
        best = max(at, key=lambda r: (r["sim_attainment"], -r["sim_latency"]))
        gap = 100 * (best["sim_attainment"] - first["sim_attainment"])
        out.append({"rate": rate, "ranked_first": first["layout"], "simulated_best": best["layout"],
                    "gap_points": gap, "ok": gap <= cfg.rank_tolerance})
    return out


def format_rows(rows: list[dict], ranks: list[dict], cfg: CalibrateConfig) -> str:
    head = (f"{'req/s':>6} {'layout':<8} {'pred SLO%':>9} {'sim SLO%':>8} {'error':>7}  {'pred s':>7} {'sim s':>7}"
            f"  {'pred τ':>6} {'sim τ':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        flag = " *" if abs(r["error_points"]) > cfg.tolerance else ""
        lines.append(f"{r['rate']:>6g} {r['layout']:<8} {100 * r['pred_attainment']:>9.1f} "
                     f"{100 * r['sim_attainment']:>8.1f} {r['error_points']:>+7.1f}  {r['pred_latency']:>7.2f} "
                     f"{r['sim_latency']:>7.2f}  {r['pred_tau']:>6.3f} {r['sim_tau']:>6.3f}{flag}")
    lines.append("")
    for k in ranks:
        lines.append(f"{k['rate']:>6g} req/s: ranked first {k['ranked_first']}, simulated best {k['simulated_best']}, "
                     f"gap {k['gap_points']:.1f} points" + ("" if k["ok"] else f"  (> {cfg.rank_tolerance:g})"))
    errs = [abs(r["error_points"]) for r in rows]
    within = sum(e <= cfg.tolerance for e in errs)
    lines.append(f"\nattainment error: max {max(errs):.1f} points, mean {np.mean(errs):.1f}; {within} of {len(errs)} "
                 f"points within {cfg.tolerance:g}; first choice within {cfg.rank_tolerance:g} points of the best at "
                 f"{sum(k['ok'] for k in ranks)} of {len(ranks)} loads")
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, lay in enumerate(dict.fromkeys(r["layout"] for r in rows)):
        rs = [r for r in rows if r["layout"] == lay]
        color = f"C{i}"
        ax.plot([r["rate"] for r in rs], [100 * r["sim_attainment"] for r in rs], "-o", color=color,
                label=f"{lay} simulated")
        ax.plot([r["rate"] for r in rs], [100 * r["pred_attainment"] for r in rs], "--x", color=color,
                label=f"{lay} predicted")
    ax.set_xlabel("arrival rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def calibrate(cfg: CalibrateConfig) -> tuple[list[dict], list[dict], float]:
    """Run the grid; (rows, per-rate ranking, wall seconds)."""
    layouts = [layout_text(parse_layout(x)) for x in (cfg.layouts or default_layouts(cfg.devices))]
    jobs = [{"cfg": cfg, "rate": rate, "seed": seed, "layout": lay, "layouts": layouts}
            for rate in cfg.rates for seed in cfg.seeds for lay in ["predict", *layouts]]
    # the slowest (narrow layouts at high rates) first, so the pool ends together
    order = sorted(jobs, key=lambda j: (j["layout"] == "predict", -j["rate"]))
    bar = None
    if cfg.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(jobs), desc="calibration", unit="run", file=sys.stderr)
    t0 = time.perf_counter()
    results = []
    if cfg.jobs == 1:
        mapped = map(_job, order)
        pool = None
    else:
        pool = ProcessPoolExecutor(max_workers=cfg.jobs)
        mapped = pool.map(_job, order)
    try:
        for res in mapped:
            results.append(res)
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"{res['layout']} @ {res['rate']:g}")
    finally:
        if pool is not None:
            pool.shutdown()
        if bar is not None:
            bar.close()
    rows = collect(cfg, results, layouts)
    return rows, ranking(cfg, rows), time.perf_counter() - t0


@returns_exit_status
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    cfg = config_from_args(CalibrateConfig, parser.parse_args(argv), parser)
    setup_logging(log)
    workload = f"Poisson, {'lengths from ' + Path(cfg.lengths).name if cfg.lengths else 'fixed lengths'}"
    log.info(f"{len(cfg.rates)} loads x {len(cfg.seeds)} seeds on {cfg.devices} devices ({workload}), "
             f"{cfg.duration:g} s of arrivals per point")
    rows, ranks, wall = calibrate(cfg)
    if cfg.json:
        print(json.dumps({"rows": rows, "ranking": ranks, "wall_s": wall}, indent=1))
    else:
        print(format_rows(rows, ranks, cfg))
        print(f"({wall:.0f} s wall)")
    if cfg.plot:
        plot(rows, cfg.plot, f"controller vs simulator: {workload}, {cfg.devices} devices")
        log.info(f"wrote {cfg.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
