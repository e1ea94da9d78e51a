"""`python -m dilaserve_jax.bench.host_time`: the engine loop's own cost per iteration at a given queue depth.

One instance on the fake runner and a fake clock (the runner's step costs no host time, so what is
measured is the loop's: mailbox, schedule with the threshold controller's plan, update, publish).
`queue + slots` requests are submitted at once, each with a long answer (256 positions) so few
finish while it runs, and deadlines spread from tight to loose (`slo_range` seconds) so the planner
has at-risk and feasible requests to weigh; then `iterations` iterations run. Reported per depth:
the host time per iteration by phase (`serving/cluster/iteration_trace.py`; median and p90 over
iterations), and the controller's pricing work per iteration (`CountingController`: steps left
worked out, and step-time terms worked out; counted, so they do not depend on the machine's load).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import numpy as np

from dilaserve_jax.core.cli import add_config_arguments, config_from_args, opt, returns_exit_status
from dilaserve_jax.serving.cluster.engine import Engine
from dilaserve_jax.serving.cluster.fake_runner import FakeClock, FakeRunner, fake_profile
from dilaserve_jax.serving.cluster.iteration_trace import HOST_PHASES, IterationTracer
from dilaserve_jax.serving.policy.latency import LatencyModel
from dilaserve_jax.serving.policy.request import make_request
from dilaserve_jax.serving.policy.scheduler import POLICIES, Scheduler, SchedulerConfig
from dilaserve_jax.serving.policy.threshold import ThresholdConfig, ThresholdController


class CountingController(ThresholdController):
    """The threshold controller, counting its pricing work: how many times it works out a
    request's steps left at a τ (`steps_priced`) and the time terms of its steps at a batch
    (`times_priced`). Memoised prices are not counted: they cost a dictionary lookup; nor are the
    plan's own step counts per τ (`_dur`: a few integer divisions, at most the planned requests x
    the τ grid per round, whatever the queue)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.calls = {k: 0 for k in PRICED}

    def _price_step_costs(self, *args, **kw):
        self.calls["times_priced"] += 1
        return super()._price_step_costs(*args, **kw)

    def _count_steps(self, *args, **kw):
        self.calls["steps_priced"] += 1
        return super()._count_steps(*args, **kw)


PRICED = ("times_priced", "steps_priced")


@dataclass(frozen=True, slots=True)
class HostTimeConfig:
    queues: tuple[int, ...] = opt((0, 32, 256), "queue depths to measure at (requests waiting besides the slots')")
    policies: tuple[str, ...] = opt(("dilaserve",), "scheduling policies", choices=POLICIES)
    slots: int = opt(8, "slots of the instance")
    iterations: int = opt(300, "engine iterations measured per depth")
    slo_range: tuple[float, float] = opt((0.5, 30.0), "deadlines uniform in LO..HI seconds after submission",
                                         metavar=("LO", "HI"))
    seed: int = opt(0, "seed of the deadlines and prompts")
    json: bool = opt(False, "print JSON")

    def __post_init__(self):
        if self.slots < 1 or self.iterations < 1 or any(q < 0 for q in self.queues):
            raise ValueError("slots and iterations must be >= 1, queue depths >= 0")


def measure(policy: str, queue: int, cfg: HostTimeConfig) -> dict:
    """Run `cfg.iterations` iterations with `queue` requests waiting; per-iteration host time and calls."""
    clock = FakeClock()
    latency = LatencyModel.from_profile(fake_profile())
    ctl = CountingController(ThresholdConfig())
    sched = Scheduler(SchedulerConfig(cfg.slots, policy=policy, max_queue=queue + cfg.slots + 1), latency, ctl)
    engine = Engine(FakeRunner(cfg.slots, clock), sched, clock=clock)
    rng = np.random.default_rng(cfg.seed)
    for i in range(queue + cfg.slots):
        prompt = tuple(int(x) for x in rng.integers(3, 100, size=32))
        engine.submit(make_request(f"q{i}", prompt, 256, 32, 0.0, float(rng.uniform(*cfg.slo_range))))
    engine.step_once()  # admits the first slots' worth: the queue is at its depth from here on
    engine.tracer = tracer = IterationTracer(clock)
    calls = []
    for _ in range(cfg.iterations):
        before = dict(ctl.calls)
        if not engine.step_once():
            break
        calls.append({k: ctl.calls[k] - before[k] for k in before})
    recs = tracer.records
    host = np.array([r.host_s for r in recs])
    out = {"policy": policy, "queue": queue, "iterations": len(recs),
           "waiting_min": min(r.waiting for r in recs), "waiting_max": max(r.waiting for r in recs),
           "host_ms_p50": 1e3 * float(np.median(host)), "host_ms_p90": 1e3 * float(np.percentile(host, 90)),
           "phases_ms_p50": {p: 1e3 * float(np.median([r.phases.get(p, 0.0) for r in recs])) for p in HOST_PHASES}}
    for k in PRICED:
        v = [c[k] for c in calls]
        out[f"{k}_mean"], out[f"{k}_max"] = float(np.mean(v)), int(max(v))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dilaserve_jax.bench.host_time",
        description="The engine loop's host time per iteration (mailbox, schedule, update, publish) and the "
                    "threshold controller's calls per iteration, at given queue depths, on the fake runner.")
    return add_config_arguments(p, HostTimeConfig)


@returns_exit_status
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    cfg = config_from_args(HostTimeConfig, parser.parse_args(argv), parser)
    rows = [measure(p, q, cfg) for p in cfg.policies for q in cfg.queues]
    if cfg.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'policy':<12}{'queue':>6}{'iters':>6} | {'host ms p50':>11}{'p90':>7} | "
          + "".join(f"{p:>9}" for p in HOST_PHASES) + f" | {'times_priced/it':>16}{'max':>6}"
          f"{'steps_priced/it':>16}{'max':>6}")
    for r in rows:
        print(f"{r['policy']:<12}{r['queue']:>6}{r['iterations']:>6} | {r['host_ms_p50']:>11.3f}{r['host_ms_p90']:>7.3f} | "
              + "".join(f"{r['phases_ms_p50'][p]:>9.3f}" for p in HOST_PHASES)
              + f" | {r['times_priced_mean']:>16.1f}{r['times_priced_max']:>6}"
              f"{r['steps_priced_mean']:>16.1f}{r['steps_priced_max']:>6}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
