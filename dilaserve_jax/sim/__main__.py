"""`python -m dilaserve_jax.sim`: simulate a serving cluster on a workload and print its report."""
from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass

import numpy as np

from dilaserve_jax.core.cli import (add_config_arguments, config_from_args, opt, returns_exit_status,
                                    setup_logging)
from dilaserve_jax.serving.policy.controller import ControllerConfig
from dilaserve_jax.sim.report import format_table, summarize
from dilaserve_jax.sim.setup import MODELS, ModelSetup, setup_model
from dilaserve_jax.sim.simulator import SimConfig, SimResult, Simulation
from dilaserve_jax.sim.slos import assign_slos
from dilaserve_jax.sim.workload import (RequestSpec, TinyShapes, arrival_times, build_shapes, is_synthetic,
                                        load_trace, parse_slo)

log = logging.getLogger(__name__)
CONTROLLER_FLAGS = ("interval_s", "min_dwell_s", "bandwidth_gbps", "compile_s", "load_s", "price_answer_ends",
                    "feedback_min_requests", "price_bursts", "latency_at_answer_ends", "latency_rate_margin",
                    "refine_candidates", "latency_feedback_requests",
                    "switch_attainment_tolerance", "late_wait_rounds")


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """The arrivals, lengths and SLOs of a run (shared with the live load generator, `bench.serving`)."""

    trace: str = opt("poisson:2", "arrivals: a trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens; e.g. the Azure "
                                  "2023 code trace at ../shared/traces/azure_llm_2023_code.csv; repeated when "
                                  "--duration is longer), poisson:RATE, bursty:RATE[:CV], "
                                  "diurnal:RATE[:PERIOD[:AMP]] (RATE·(1+AMP·sin(2πt/PERIOD))) or "
                                  "steps:RATE@SECONDS,... (piecewise-constant Poisson, e.g. steps:20@300,90@300,20@300; "
                                  "--duration defaults to the steps' total)")
    lengths: str | None = opt(None, "synthetic arrivals: draw prompt/answer lengths from this trace CSV",
                              metavar="CSV", default_text="fixed lengths")
    rate_scale: float = opt(1.0, "multiply the arrival rate (a trace's gaps are divided by it)")
    duration: float | None = opt(None, "seconds of arrivals (required for synthetic arrivals)",
                                 default_text="the whole trace")
    slo: str = opt("idle:2,6", "per-request SLO: idle:LO,HI = uniform(LO, HI) x the request's idle latency, or "
                               "fixed:SECONDS")
    seed: int = opt(0, "workload and model seed")

    def __post_init__(self):
        if not self.rate_scale > 0:
            raise ValueError(f"--rate-scale must be positive, got {self.rate_scale}")


def add_workload_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The workload options, shared with the live load generator (`bench.serving`)."""
    return add_config_arguments(p, WorkloadConfig)


@dataclass(frozen=True, slots=True)
class SimCommand:
    """What the simulation models and reports, beside the cluster (SimConfig) and the workload."""

    model: str = opt("llada_8b", "modelled model", choices=MODELS)
    profile: str | None = opt(None, "h100, a100, h200 (analytic LLaDA-8B roofline) or a measured profile JSON",
                              default_text="h100 for llada_8b; required for tiny")
    eval_rows: str | None = opt(None, "tiny: eval rows with trajectories", default_text="the shipped eval.json")
    layout: str | None = opt(None, "mesh spec (2x4, 8x1, 4+2+1+1, ...), auto (dilaserve: the controller reshapes) "
                                   "or schedule:LAYOUT@SECONDS,... (switched at those times whatever the load: "
                                   "an oracle, e.g. schedule:1x8@0,8x1@300,1x8@600)",
                             default_text="auto for dilaserve, required otherwise")
    slo_tp: int = opt(1, "TP degree of the instance idle latencies refer to")
    length_buckets: str | None = opt(None, "comma-separated canvas buckets the decoder compiles (a step runs once "
                                           "per bucket among its requests, batch padded to a power of two), or none "
                                           "(one step at the longest canvas)",
                                     default_text="256,...,4096 for llada_8b, the profile's lengths for tiny")
    step_noise: float = opt(0.0, "log-normal sigma of step-time noise around the profile")
    json: bool = opt(False, "print the report (and the run's details) as JSON")
    records: str | None = opt(None, "write one JSON line per request to FILE", metavar="FILE")
    plot: str | None = opt(None, "draw load, attainment, latency and layout over time", metavar="PNG")
    progress: bool = opt(True, "progress bar on stderr")

    @property
    def buckets(self) -> tuple[int, ...] | None:
        if self.length_buckets is None:
            return None
        return () if self.length_buckets == "none" else tuple(int(x) for x in self.length_buckets.split(","))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dilaserve_jax.sim",
        description="Discrete-event simulation of a DiLaServe cluster: the real scheduler, threshold controller, "
                    "router and cluster controller on virtual time, over modelled instances (step times from a latency "
                    "profile, commits and accuracy from measured eval trajectories or a published table). Prints SLO "
                    "attainment, mean/p99 latency, accuracy, mean τ, rejections, reconfigurations and migrations.")
    add_workload_args(p)
    add_config_arguments(p, SimCommand, only=("model", "profile", "eval_rows"))
    add_config_arguments(p, SimConfig, exclude=("layout", "controller", "seed"))
    add_config_arguments(p, SimCommand, only=("layout", "slo_tp"))
    add_config_arguments(p, ControllerConfig, only=CONTROLLER_FLAGS)
    return add_config_arguments(p, SimCommand, exclude=("model", "profile", "eval_rows", "layout", "slo_tp"))


def configs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[SimConfig, WorkloadConfig, SimCommand]:
    """The run's cluster, workload and command options from the parsed flags (usage errors exit 2)."""
    workload, command = config_from_args(WorkloadConfig, args, parser), config_from_args(SimCommand, args, parser)
    layout = command.layout or ("auto" if args.policy == "dilaserve" else None)
    if layout is None:
        parser.error(f"--policy {args.policy} needs a fixed --layout (e.g. 2x4)")
    cfg = config_from_args(SimConfig, args, parser, layout=layout, seed=workload.seed,
                           controller=config_from_args(ControllerConfig, args, parser))
    return cfg, workload, command


def make_specs(workload: WorkloadConfig, m: ModelSetup, *, model: str, tau: float, slo_tp: int) -> list[RequestSpec]:
    """The requests of a workload, their SLOs set from the modelled idle latencies."""
    rng = np.random.default_rng([workload.seed, 1])
    synthetic = is_synthetic(workload.trace)
    trace = None if synthetic else load_trace(workload.trace)
    lengths = load_trace(workload.lengths) if synthetic and workload.lengths else None
    times = arrival_times(workload.trace, duration=workload.duration, rate_scale=workload.rate_scale, rng=rng,
                          trace=trace)
    tiny = TinyShapes(seed=workload.seed) if model == "tiny" else None
    shapes = build_shapes(model, len(times), rng, trace=trace if trace is not None else lengths,
                          from_trace_rows=not synthetic, max_len=m.max_len, tiny=tiny)
    specs = [RequestSpec(float(t), s.task, s.prompt_tokens or (0,) * s.prompt_len, s.answer_length, s.block_length,
                         s.finish_tokens, problem=s.problem) for t, s in zip(times, shapes)]
    return assign_slos(specs, parse_slo(workload.slo), quality=m.quality, step_time=m.step_time, tau=tau, tp=slo_tp,
                       seed=workload.seed)


def run(cfg: SimConfig, workload: WorkloadConfig, command: SimCommand) -> tuple[dict, SimResult]:
    cpu0, wall0 = time.process_time(), time.perf_counter()
    t0 = time.perf_counter()
    m = setup_model(command.model, command.profile, eval_rows=command.eval_rows, seed=workload.seed,
                    noise=command.step_noise, tp_degrees=cfg.tp_degrees, slots=cfg.slots,
                    length_buckets=command.buckets)
    specs = make_specs(workload, m, model=command.model, tau=cfg.static_tau, slo_tp=command.slo_tp)
    log.info(f"{len(specs)} requests over {specs[-1].arrival if specs else 0:.0f} s; profile: {m.profile.label}; "
             f"quality: {m.quality.source or m.quality.name} (set up in {time.perf_counter() - t0:.1f} s)")
    sim = Simulation(cfg, specs, step_time=m.step_time, latency=m.latency, quality=m.quality, prior=m.prior,
                     param_bytes=m.param_bytes, progress=command.progress, eval_rows=m.eval_rows)
    res = sim.run()
    duration = workload.duration or (specs[-1].arrival if specs else 0.0)
    row = {"system": cfg.name, "rate": len(specs) / duration if duration else 0.0, **summarize(res.records, duration=duration),
           "reconfigurations": len(res.reconfigurations), "migrations": res.migrations.get("at risk", 0),
           "moved_on_reconfigure": res.migrations.get("reconfigure", 0), "wall_s": res.wall_s, "sim_s": res.sim_s,
           "total_wall_s": time.perf_counter() - wall0, "total_cpu_s": time.process_time() - cpu0,
           "final_layout": res.layouts[-1][1], "start_layout": res.layouts[0][1], "devices": cfg.devices,
           "model": command.model, "profile": m.profile.label}
    if res.step_stats is not None:
        row["steps"] = res.step_stats.to_json(row["completed"])
        row["steps_note"] = res.step_stats.describe(row["completed"])
    if m.quality.extrapolated_below:
        row["accuracy_note"] = (f"accuracy below τ {m.quality.extrapolated_below:g} is extrapolated from the published "
                                f"points ({100 * row.get('extrapolated_share', 0.0):.1f}% of committed positions)")
    return row, res


def plot_timeline(res: SimResult, path: str, bin_s: float = 30.0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = res.records
    end = max([r.arrival for r in recs] + [0.0]) + bin_s
    edges = np.arange(0.0, end + bin_s, bin_s)
    arr = np.array([r.arrival for r in recs])
    idx = np.digitize(arr, edges) - 1
    rate = np.bincount(idx, minlength=len(edges)) / bin_s
    met = np.bincount(idx, weights=[float(r.met) for r in recs], minlength=len(edges))
    cnt = np.bincount(idx, minlength=len(edges))
    lat = np.bincount(idx, weights=[(r.latency or 0.0) for r in recs], minlength=len(edges))
    x = edges[:len(rate)]
    fig, axes = plt.subplots(3, 1, figsize=(9, 6), sharex=True)
    axes[0].step(x, rate, where="post")
    axes[0].set_ylabel("arrivals/s")
    with np.errstate(invalid="ignore", divide="ignore"):
        axes[1].step(x, 100 * met / cnt, where="post")
        axes[2].step(x, lat / cnt, where="post")
    axes[1].set_ylabel("SLO met %")
    axes[2].set_ylabel("mean latency s")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("seconds")
    for t, layout in res.layouts[1:]:
        for ax in axes:
            ax.axvline(t, color="grey", lw=0.6, ls=":")
        axes[0].annotate(layout, (t, rate.max() if len(rate) else 1), fontsize=6, rotation=90, va="top")
    axes[0].set_title(f"{res.config.name}: layout {res.layouts[0][1]} at start; dotted lines: switches", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


@returns_exit_status
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    cfg, workload, command = configs(parser, parser.parse_args(argv))
    setup_logging(log)
    try:
        row, res = run(cfg, workload, command)
    except (ValueError, FileNotFoundError, KeyError) as err:
        log.error(f"error: {err}")
        return 2
    if command.records:
        with open(command.records, "w") as f:
            for r in res.records:
                f.write(json.dumps({k: getattr(r, k) for k in r.__slots__}) + "\n")
    if command.json:
        print(json.dumps({"report": row, "reconfigurations": [str(r) for r in res.reconfigurations],
                          "layouts": res.layouts}, indent=1))
    else:
        print(format_table([row]))
        print(f"layout {row['start_layout']} -> {row['final_layout']}; {row['reconfigurations']} reconfigurations "
              f"({row['moved_on_reconfigure']} requests moved), {row['migrations']} at-risk migrations; "
              f"{row['sim_s']:.0f} s simulated in {row['wall_s']:.1f} s wall; with the workload's set-up "
              f"{row['total_wall_s']:.1f} s wall, {row['total_cpu_s']:.1f} s CPU")
        if "accuracy_drop_points" in row:
            budget = "unbounded" if cfg.max_accuracy_drop is None else f"{cfg.max_accuracy_drop:g} points"
            print(f"accuracy: expected {100 * row['expected_accuracy']:.2f}% ({row['accuracy_drop_points']:+.2f} points "
                  f"below the same requests at τ_max); serving budget {budget}, mean predicted loss "
                  f"{row.get('predicted_loss_points', 0.0):.2f} points")
        if "accuracy_note" in row:
            print(row["accuracy_note"])
        if "steps_note" in row:
            print(row["steps_note"])
    if command.plot:
        plot_timeline(res, command.plot)
        log.info(f"wrote {command.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
