"""`python -m dilaserve_jax.sim`: simulate a serving cluster on a workload and print its report."""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from dilaserve_jax.serving.policy.controller import ControllerConfig
from dilaserve_jax.serving.policy.scheduler import POLICIES
from dilaserve_jax.sim.policies import ABLATIONS
from dilaserve_jax.sim.report import format_table, summarize
from dilaserve_jax.sim.setup import MODELS, ModelSetup, setup_model
from dilaserve_jax.sim.simulator import SimConfig, SimResult, Simulation, assign_slos
from dilaserve_jax.sim.workload import (RequestSpec, TinyShapes, arrival_times, build_shapes, is_synthetic,
                                        load_trace, parse_slo)


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload options, shared with the live load generator (`bench.serving`)."""
    p.add_argument("--trace", default="poisson:2",
                   help="arrivals: a trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens; e.g. the Azure 2023 code "
                        "trace at ../shared/traces/azure_llm_2023_code.csv), poisson:RATE, bursty:RATE[:CV] or "
                        "diurnal:RATE[:PERIOD[:AMP]] (default poisson:2)")
    p.add_argument("--lengths", default=None, metavar="CSV",
                   help="synthetic arrivals: draw prompt/answer lengths from this trace CSV (default: fixed lengths)")
    p.add_argument("--rate-scale", type=float, default=1.0,
                   help="multiply the arrival rate (a trace's gaps are divided by it; default 1)")
    p.add_argument("--duration", type=float, default=None,
                   help="seconds of arrivals (default: the whole trace; required for synthetic arrivals)")
    p.add_argument("--slo", default="idle:2,6",
                   help="per-request SLO: idle:LO,HI = uniform(LO, HI) x the request's idle latency, or fixed:SECONDS "
                        "(default idle:2,6)")
    p.add_argument("--seed", type=int, default=0, help="workload and model seed (default 0)")


def build_parser() -> argparse.ArgumentParser:
    d, c = SimConfig(), ControllerConfig()
    p = argparse.ArgumentParser(
        prog="python -m dilaserve_jax.sim",
        description="Discrete-event simulation of a DiLaServe cluster: the real scheduler, threshold controller, "
                    "router and cluster controller on virtual time, over modelled instances (step times from a latency "
                    "profile, commits and accuracy from measured eval trajectories or a published table). Prints SLO "
                    "attainment, mean/p99 latency, accuracy, mean τ, rejections, reconfigurations and migrations.")
    add_workload_args(p)
    p.add_argument("--model", default="llada_8b", choices=MODELS, help="modelled model (default llada_8b)")
    p.add_argument("--profile", default=None,
                   help="h100, a100, h200 (analytic LLaDA-8B roofline) or a measured profile JSON (default h100 for "
                        "llada_8b; required for tiny)")
    p.add_argument("--eval-rows", default=None, help="tiny: eval rows with trajectories (default: the shipped eval.json)")
    p.add_argument("--devices", type=int, default=d.devices, help=f"devices in the cluster (default {d.devices})")
    p.add_argument("--policy", default=d.policy, choices=POLICIES, help=f"scheduling policy (default {d.policy})")
    p.add_argument("--layout", default=None,
                   help="mesh spec (2x4, 8x1, 4+2+1+1, ...) or auto (dilaserve: the controller reshapes; default auto "
                        "for dilaserve, required otherwise)")
    p.add_argument("--layouts", default=None, help="auto: comma-separated candidate layouts (default: all partitions)")
    p.add_argument("--initial-layout", default=None,
                   help="auto: starting layout (default: the one predicted best for the first window of arrivals)")
    p.add_argument("--tp", type=int, nargs="+", default=list(d.tp_degrees), help="TP degrees allowed (default 1 2 4 8)")
    p.add_argument("--ablate", default="", help=f"dilaserve without: comma-separated of {', '.join(ABLATIONS)}")
    p.add_argument("--slots", type=int, default=d.slots, help=f"slots per instance (default {d.slots})")
    p.add_argument("--max-queue", type=int, default=d.max_queue,
                   help=f"waiting requests per instance before rejection (default {d.max_queue}, as serve)")
    p.add_argument("--tau-min", type=float, default=d.tau_min, help=f"per-request τ floor (default {d.tau_min})")
    p.add_argument("--tau-max", type=float, default=d.tau_max, help=f"per-request τ ceiling (default {d.tau_max})")
    p.add_argument("--max-accuracy-drop", type=_points, default=d.max_accuracy_drop,
                   help="dilaserve: the serving accuracy budget, mean predicted drop vs τ_max in points, or none "
                        f"(unbounded; default {d.max_accuracy_drop:g})")
    p.add_argument("--budget-mode", default=d.budget_mode, choices=("adaptive", "floor"),
                   help=f"budget mode, as serve's (default {d.budget_mode})")
    p.add_argument("--static-tau", type=float, default=d.static_tau, help=f"τ of the static policies (default {d.static_tau})")
    p.add_argument("--slo-tp", type=int, default=1, help="TP degree of the instance idle latencies refer to (default 1)")
    p.add_argument("--interconnect-gbps", type=float, default=c.bandwidth_gbps,
                   help=f"GB/s into each device when resharding (default {c.bandwidth_gbps:g})")
    p.add_argument("--compile-s", type=float, default=c.compile_s,
                   help=f"seconds to compile a placement never seen (default {c.compile_s:g})")
    p.add_argument("--controller-interval-s", type=float, default=c.interval_s, help="seconds between control rounds")
    p.add_argument("--min-dwell-s", type=float, default=c.min_dwell_s, help="minimum seconds between switches")
    p.add_argument("--length-buckets", default=None,
                   help="comma-separated canvas buckets the decoder compiles (a step runs once per bucket among its "
                        "requests, batch padded to a power of two), or none (one step at the longest canvas); default: "
                        "256,...,4096 for llada_8b, the profile's lengths for tiny")
    p.add_argument("--step-noise", type=float, default=0.0,
                   help="log-normal sigma of step-time noise around the profile (default 0)")
    p.add_argument("--json", action="store_true", help="print the report (and the run's details) as JSON")
    p.add_argument("--records", default=None, metavar="FILE", help="write one JSON line per request to FILE")
    p.add_argument("--plot", default=None, metavar="PNG", help="draw load, attainment, latency and layout over time")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def _points(text: str) -> float | None:
    if text.lower() in ("none", "unbounded", "inf"):
        return None
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError("the accuracy budget is >= 0 points (or none)")
    return value


def make_specs(args, m: ModelSetup, *, model: str, tau: float, slo_tp: int) -> list[RequestSpec]:
    """The workload of the command-line options (shared with the live load generator)."""
    rng = np.random.default_rng([args.seed, 1])
    synthetic = is_synthetic(args.trace)
    trace = None if synthetic else load_trace(args.trace)
    lengths = load_trace(args.lengths) if synthetic and args.lengths else None
    times = arrival_times(args.trace, duration=args.duration, rate_scale=args.rate_scale, rng=rng, trace=trace)
    tiny = TinyShapes(seed=args.seed) if model == "tiny" else None
    shapes = build_shapes(model, len(times), rng, trace=trace if trace is not None else lengths,
                          from_trace_rows=not synthetic, max_len=m.max_len, tiny=tiny)
    specs = [RequestSpec(float(t), s.task, s.prompt_tokens or (0,) * s.prompt_len, s.answer_length, s.block_length,
                         s.finish_tokens, problem=s.problem) for t, s in zip(times, shapes)]
    return assign_slos(specs, parse_slo(args.slo), quality=m.quality, step_time=m.step_time, tau=tau, tp=slo_tp,
                       seed=args.seed)


def run(args, say) -> tuple[dict, SimResult]:
    cpu0, wall0 = time.process_time(), time.perf_counter()
    ablate = frozenset(a for a in args.ablate.split(",") if a)
    layout = args.layout or ("auto" if args.policy == "dilaserve" else None)
    if layout is None:
        raise ValueError(f"--policy {args.policy} needs a fixed --layout (e.g. 2x4)")
    ccfg = ControllerConfig(interval_s=args.controller_interval_s, min_dwell_s=args.min_dwell_s,
                            bandwidth_gbps=args.interconnect_gbps, compile_s=args.compile_s)
    cfg = SimConfig(devices=args.devices, policy=args.policy, layout=layout, initial_layout=args.initial_layout,
                    layouts=tuple(x for x in (args.layouts or "").split(",") if x), tp_degrees=tuple(args.tp),
                    ablate=ablate, slots=args.slots, max_queue=args.max_queue, static_tau=args.static_tau, tau_min=args.tau_min,
                    tau_max=args.tau_max, controller=ccfg, max_accuracy_drop=args.max_accuracy_drop,
                    budget_mode=args.budget_mode, seed=args.seed)
    t0 = time.perf_counter()
    buckets = None if args.length_buckets is None else (
        () if args.length_buckets == "none" else tuple(int(x) for x in args.length_buckets.split(",")))
    m = setup_model(args.model, args.profile, eval_rows=args.eval_rows, seed=args.seed, noise=args.step_noise,
                    tp_degrees=cfg.tp_degrees, slots=cfg.slots, length_buckets=buckets)
    specs = make_specs(args, m, model=args.model, tau=cfg.static_tau, slo_tp=args.slo_tp)
    say(f"{len(specs)} requests over {specs[-1].arrival if specs else 0:.0f} s; profile: {m.profile.label}; "
        f"quality: {m.quality.source or m.quality.name} (set up in {time.perf_counter() - t0:.1f} s)")
    sim = Simulation(cfg, specs, step_time=m.step_time, latency=m.latency, quality=m.quality, prior=m.prior,
                     param_bytes=m.param_bytes, progress=not args.no_progress, eval_rows=m.eval_rows)
    res = sim.run()
    duration = args.duration or (specs[-1].arrival if specs else 0.0)
    row = {"system": cfg.name, "rate": len(specs) / duration if duration else 0.0, **summarize(res.records, duration=duration),
           "reconfigurations": len(res.reconfigurations), "migrations": res.migrations.get("at risk", 0),
           "moved_on_reconfigure": res.migrations.get("reconfigure", 0), "wall_s": res.wall_s, "sim_s": res.sim_s,
           "total_wall_s": time.perf_counter() - wall0, "total_cpu_s": time.process_time() - cpu0,
           "final_layout": res.layouts[-1][1], "start_layout": res.layouts[0][1], "devices": cfg.devices,
           "model": args.model, "profile": m.profile.label}
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    try:
        row, res = run(args, say)
    except (ValueError, FileNotFoundError, KeyError) as err:
        say(f"error: {err}")
        return 2
    if args.records:
        with open(args.records, "w") as f:
            for r in res.records:
                f.write(json.dumps({k: getattr(r, k) for k in r.__slots__}) + "\n")
    if args.json:
        print(json.dumps({"report": row, "reconfigurations": [str(r) for r in res.reconfigurations],
                          "layouts": res.layouts}, indent=1))
    else:
        print(format_table([row]))
        print(f"layout {row['start_layout']} -> {row['final_layout']}; {row['reconfigurations']} reconfigurations "
              f"({row['moved_on_reconfigure']} requests moved), {row['migrations']} at-risk migrations; "
              f"{row['sim_s']:.0f} s simulated in {row['wall_s']:.1f} s wall; with the workload's set-up "
              f"{row['total_wall_s']:.1f} s wall, {row['total_cpu_s']:.1f} s CPU")
        if "accuracy_drop_points" in row:
            budget = "unbounded" if args.max_accuracy_drop is None else f"{args.max_accuracy_drop:g} points"
            print(f"accuracy: expected {100 * row['expected_accuracy']:.2f}% ({row['accuracy_drop_points']:+.2f} points "
                  f"below the same requests at τ_max); serving budget {budget}, mean predicted loss "
                  f"{row.get('predicted_loss_points', 0.0):.2f} points")
        if "accuracy_note" in row:
            print(row["accuracy_note"])
    if args.plot:
        plot_timeline(res, args.plot)
        say(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
