"""`python -m dilaserve_jax.bench.trace_diff`: a real run and its simulation, iteration by iteration.

Reads the real runs `bench.sim_validate --out DIR` saved (DIR/measured.json: each run's arrivals,
requests and its engine's iteration trace), simulates each selected run on the same arrivals with
the inputs `bench.sim_validate` feeds the simulator, recording the simulated engine's iterations
too, and prints the comparison of `sim/trace_compare.py`: the first divergence, the time
accounting of both sides (steps, host time, idle), host time per step by queue depth, the wait
from arrival to first step, and the step time per (kind, batch) against the noise-free model.
No JAX: it runs anywhere the saved file is.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dilaserve_jax.core.cli import add_config_arguments, config_from_args, opt, returns_exit_status, setup_logging
from dilaserve_jax.serving.cluster.iteration_trace import IterationRecord
from dilaserve_jax.serving.policy.scheduler import POLICIES
from dilaserve_jax.sim.trace_compare import format_comparison, normalized

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TraceDiffConfig:
    from_file: str = opt("", "the real runs: measured.json written by bench.sim_validate --out", name="--from",
                         metavar="FILE")
    policies: tuple[str, ...] = opt((), "only these policies' runs", choices=POLICIES, default_text="all")
    loads: tuple[float, ...] = opt((), "only the runs at these load factors", default_text="all")
    repeat: int | None = opt(None, "only this pass of each point (0 is the first)", default_text="all")
    noise: str = opt("timeline", "simulated step-time noise: the run's slowdown over time replayed (timeline), "
                                 "the pooled spread resampled (iid), or none", choices=("timeline", "iid", "none"))
    host_model: str = opt("mean", "simulated host time per iteration: the mean per step (mean, as bench.sim_validate "
                                  "by default), or fitted on (batch, queue) from the real traces (fit)",
                          choices=("mean", "fit"))
    work: str = opt("eval", "each simulated request's commits: drawn from its task's eval rows (eval), or the "
                            "pool prompt's own as the real run measured them at one τ (own)", choices=("eval", "own"))
    seed: int = opt(0, "simulator seed")

    def __post_init__(self):
        if not self.from_file:
            raise ValueError("--from FILE is required (measured.json of bench.sim_validate --out)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dilaserve_jax.bench.trace_diff",
        description="Simulate the real runs saved by bench.sim_validate --out on the same arrivals, record both "
                    "engines iteration by iteration, and print the first divergence and where the two differ "
                    "(host time by queue depth, arrival to first step, step time per shape).")
    return add_config_arguments(p, TraceDiffConfig)


def diff_run(measured: dict, run_: dict, step_time, latency, hosts: dict, cfg: TraceDiffConfig) -> str:
    from dilaserve_jax.bench.sim_inputs import build_simulation, run_inputs

    st, host, own = run_inputs(measured, run_, step_time, cfg.noise, hosts, cfg.work)
    prior = {float(t): v for t, v in measured["prior"].items()} or None
    sim = build_simulation(measured["info"], run_["policy"], run_["trace"], measured["items"], cfg.seed,
                           step_time=st, latency=latency, prior=prior, eval_rows=measured.get("eval_rows"),
                           host_time=host, traced=True, own=own)
    sim.run()
    start = run_["records"][0]["arrival"] - run_["trace"][0][0]
    real = normalized([IterationRecord.from_json(d) for d in run_["iterations"]], start)
    simulated = normalized(next(iter(sim.traces.values())).records)
    items, trace = measured["items"], run_["trace"]
    shapes = {str(k): (len(items[i]["tokens"]) + items[i]["answer"], items[i]["block"])
              for k, (_, i, _) in enumerate(trace)}
    base = dataclasses.replace(step_time, noise=0.0, overhead_s=0.0, timeline=())
    rng = np.random.default_rng(0)

    def modelled(r: IterationRecord) -> float:
        return base.batch_seconds(r.kind, [shapes[i] for i in r.batch], 1, rng)
    return format_comparison(real, simulated, modelled)


def run(cfg: TraceDiffConfig) -> list[str]:
    from dilaserve_jax.bench.sim_inputs import host_models, step_time_model

    measured = json.loads(Path(cfg.from_file).read_text())
    runs = [r for r in measured["runs"] if (not cfg.policies or r["policy"] in cfg.policies)
            and (not cfg.loads or any(abs(r["load"] - x) < 1e-9 for x in cfg.loads))
            and (cfg.repeat is None or r.get("repeat", 0) == cfg.repeat)]
    if not runs:
        raise ValueError("no saved run matches the selection")
    if any(not r.get("iterations") for r in runs):
        raise ValueError(f"{cfg.from_file} has no iteration traces: measure again with bench.sim_validate --out")
    step_time, latency, _ = step_time_model(measured)
    hosts = host_models(measured) if cfg.host_model == "fit" else {}
    out = []
    for r in runs:
        host = hosts.get(r["policy"])
        head = (f"== {r['policy']} at load {r['load']:g} ({r['rate']:g} req/s), pass {r.get('repeat', 0) + 1}; "
                f"simulated with noise {cfg.noise}, work {cfg.work}, host time "
                + (host.describe() if host else f"{1e3 * step_time.overhead_s:.3f} ms per step"))
        out.append(head + "\n" + diff_run(measured, r, step_time, latency, hosts, cfg))
    return out


@returns_exit_status
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    cfg = config_from_args(TraceDiffConfig, parser.parse_args(argv), parser)
    setup_logging(log)
    try:
        reports = run(cfg)
    except (ValueError, FileNotFoundError) as err:
        log.error(f"error: {err}")
        return 2
    print("\n\n".join(reports))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
