"""The simulated side of `bench.sim_validate`: everything the simulator is fed, from the real runs only.

- the step time per shape (`step_time_model`: the run's own compiled calls, the start-up profile where a
  shape never occurred) and its noise: each run's slowdown over time (`contention_timeline`) or the
  pooled spread of actual over modelled step time;
- the host time per iteration: the mean per step, or fitted per policy on (batch, queue) from the
  runs' iteration traces (`host_models`, `sim/host_time.py`);
- each request's work: a problem drawn from its task's eval rows, or (`own_trajectories`) the pool
  prompt's own commits as the real run measured them at a static τ.
"""
from __future__ import annotations

import dataclasses
import json
import math

import numpy as np

from dilaserve_jax.core.buckets import padded
from dilaserve_jax.serving.policy.latency import LatencyModel, Profile
from dilaserve_jax.sim.executor import StepTimeModel
from dilaserve_jax.sim.quality import QualityModel, Template, _blocks_of
from dilaserve_jax.sim.setup import ASSETS
from dilaserve_jax.sim.simulator import SimConfig, Simulation
from dilaserve_jax.sim.workload import RequestSpec
from dilaserve_jax.tasks.prompts import prompt_hash


def build_simulation(bench_info: dict, policy: str, trace: list, items: list, seed: int, *, step_time, latency,
                     prior, eval_rows: list | None = None, host_time=None, traced: bool = False,
                     own: dict | None = None, instances: int = 1) -> Simulation:
    """The simulated instance of a real run: the same requests, arrival times, SLOs and policy.
    `own`: pool prompts that replay their own measured trajectory (`own_trajectories`);
    `instances`: that many TP-1 instances behind the serving router (layout `Nx1`)."""
    rows = json.loads((ASSETS / "eval.json").read_text())
    specs = [RequestSpec(offset, items[i]["task"], tuple(items[i]["tokens"]), items[i]["answer"], items[i]["block"],
                         None, slo) for offset, i, slo in trace]
    quality = QualityModel.from_eval_rows(rows, seed=seed)
    for key, template in (own or {}).items():
        quality.by_prompt[key] = template
    cfg = SimConfig(devices=instances, policy=policy, layout=f"{instances}x1", slots=bench_info["slots"],
                    static_tau=bench_info["static_tau"], tau_min=bench_info["tau_range"][0],
                    tau_max=bench_info["tau_range"][1], max_queue=10_000,
                    max_accuracy_drop=bench_info.get("budget"), seed=seed)
    return Simulation(cfg, specs, step_time=step_time, latency=latency, quality=quality, prior=prior,
                      param_bytes=0.0, eval_rows=eval_rows, host_time=host_time, trace=traced)


def simulate(bench_info: dict, policy: str, trace: list, items: list, *, step_time, latency, prior, seeds: int,
             eval_rows: list | None = None, host_time=None, own: dict | None = None, instances: int = 1) -> list:
    return [build_simulation(bench_info, policy, trace, items, seed, step_time=step_time, latency=latency,
                             prior=prior, eval_rows=eval_rows, host_time=host_time, own=own,
                             instances=instances).run()
            for seed in range(seeds)]


def own_trajectories(measured: dict, run_: dict) -> dict:
    """(task, prompt hash) -> a `Template` replaying the pool prompt's own measured commits, for a run
    all of whose steps ran at one τ (a static policy's: decoding is deterministic, so a prompt's
    trajectory at that τ is its own). The requests of a run at several τ (adaptive) keep the eval
    rows' draw: their trajectories at the other τ were not measured."""
    if len({round(t, 9) for r in run_["records"] for t in r.get("taus") or []}) != 1:
        return {}
    grid = len(QualityModel.from_eval_rows(json.loads((ASSETS / "eval.json").read_text())).grid)
    out = {}
    for r in run_["records"]:
        taus = r.get("taus") or []
        if r["state"] != "FINISHED_OK" or not taus or max(taus) - min(taus) > 1e-9:
            continue
        it = measured["items"][r["item"]]
        key = (it["task"], prompt_hash(it["tokens"]))
        blocks = _blocks_of(r["committed_per_step"], it["block"])
        valid = int(bool(r.get("valid")))
        out[key] = Template(it["task"], (blocks,) * grid, (valid,) * grid, key[1])
    return out


def run_inputs(measured: dict, run_: dict, step_time, noise: str, hosts: dict, work: str):
    """One real run's simulated inputs: its step-time model (noise "timeline": the run's own slowdown
    over time replayed; "iid": the pooled spread resampled; "none"), its policy's fitted host time
    (None: the step model's mean overhead) and the prompts that replay their own work (work "own")."""
    if noise == "timeline":
        step_time = dataclasses.replace(step_time, timeline=contention_timeline(run_, step_time))
    elif noise == "none":
        step_time = dataclasses.replace(step_time, noise=0.0)
    elif noise != "iid":
        raise ValueError(f"noise must be timeline, iid or none, got {noise!r}")
    host = hosts.get(run_["policy"])
    if host is not None:
        step_time = dataclasses.replace(step_time, overhead_s=0.0)
    if work not in ("eval", "own"):
        raise ValueError(f"work must be eval or own, got {work!r}")
    return step_time, host, own_trajectories(measured, run_) if work == "own" else None


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


def host_models(measured: dict) -> dict:
    """Per policy, the host time per iteration fitted on (batch, queue) over that policy's real runs
    (`sim/host_time.py`; the run's iteration traces)."""
    from dilaserve_jax.serving.cluster.iteration_trace import IterationRecord
    from dilaserve_jax.sim.host_time import HostTimeModel, host_samples

    samples: dict[str, list] = {}
    for run_ in measured["runs"]:
        # one instance's iterations, or each instance's of a run on several (`sim_validate_pair`)
        traces = list(run_["iterations_by_instance"].values()) if "iterations_by_instance" in run_ \
            else [run_.get("iterations")]
        if not all(traces):
            raise ValueError("these real runs have no iteration traces (measured before they were recorded): "
                             "use --host-model mean")
        for trace in traces:
            recs = [IterationRecord.from_json(d) for d in trace]
            samples.setdefault(run_["policy"], []).extend(host_samples(recs))
    return {p: HostTimeModel.fit(v, f"fitted on {len(v)} iterations of the real {p} runs") for p, v in samples.items()}




def contention_timeline(run_: dict, step_time) -> tuple[tuple[float, float], ...]:
    """The run's measured slowdown over time: each real step's duration over its modelled one, at the
    step's start (seconds from the run's start)."""
    start = run_["records"][0]["arrival"] - run_["trace"][0][0]  # the first arrival is start + its offset
    rng = np.random.default_rng(0)
    base = dataclasses.replace(step_time, noise=0.0, overhead_s=0.0, timeline=())
    out = [(t0 - start, (t1 - t0) / pred) for kind, shapes, t0, t1 in run_["steps"]
           if (pred := base.batch_seconds(kind, shapes, 1, rng)) > 0]
    return tuple(sorted(out))
