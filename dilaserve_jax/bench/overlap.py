"""`python -m dilaserve_jax.bench.overlap`: do two instances in one process really step concurrently?

Builds two single-device instances (engine thread + JaxRunner each) on different devices, feeds
both the same held-out requests, and measures from the step timeline how much of the time both
were inside a step at once, against running the same work on one instance after the other.
Each instance's step call releases the GIL while XLA runs, which is what lets the threads overlap.
On fake CPU devices the two instances share this machine's cores, so the overlap shows the
threading model works; the speed-up it buys is bounded by the cores, not by the design.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import time
from dataclasses import dataclass

from dilaserve_jax.core.cli import add_config_arguments, config_from_args, opt, returns_exit_status, setup_logging
from dilaserve_jax.kernels import IMPLEMENTATIONS

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class OverlapConfig:
    model: str = opt("tiny", "preset or checkpoint directory")
    attention: str = opt("auto", "attention implementation (auto = Pallas on GPU/TPU, XLA on CPU)",
                         choices=IMPLEMENTATIONS)
    requests: int = opt(16, "requests per instance")
    slots: int = opt(4, "slots per instance")
    json: bool = opt(False, "print one JSON object")

    def __post_init__(self):
        if self.requests < 1 or self.slots < 1:
            raise ValueError("--requests and --slots must be positive")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dilaserve_jax.bench.overlap",
                                description="Measure how much two in-process instances overlap their steps.")
    return add_config_arguments(p, OverlapConfig)


@returns_exit_status
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = config_from_args(OverlapConfig, parser.parse_args(argv), parser)
    setup_logging(log)
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    import jax

    from dilaserve_jax.decoding.compiled import CompiledSteps
    from dilaserve_jax.models import load_model
    from dilaserve_jax.serving.cluster.engine import Engine
    from dilaserve_jax.serving.cluster.timeline import StepTimeline
    from dilaserve_jax.serving.cluster.fake_runner import fake_profile
    from dilaserve_jax.serving.policy.latency import LatencyModel
    from dilaserve_jax.serving.policy.request import Request
    from dilaserve_jax.serving.executor.runner import JaxRunner
    from dilaserve_jax.serving.policy.scheduler import Scheduler, SchedulerConfig
    from dilaserve_jax.tasks.suite import SHORT_AREA, TASKS, task_block, unique_problems

    devices = jax.devices()[:2]
    if len(devices) < 2:
        log.error("error: needs two devices")
        return 2
    model = load_model(args.model, attention=args.attention)
    compiled = CompiledSteps(model.config, model.graphdef)
    latency = LatencyModel.from_profile(fake_profile())  # order only; every request has a loose deadline
    names = tuple(n for n, t in TASKS.items() if t.gen_length == SHORT_AREA)  # one canvas bucket
    problems = [p for name in names
                for p in unique_problems(name, "heldout", -(-args.requests // len(names)), seed=5)][:args.requests]
    engines = []
    for i, dev in enumerate(devices):
        params = jax.device_put(model.params, dev)
        runner = JaxRunner(model.config, model.graphdef, params, num_slots=args.slots, length_buckets=(64,),
                           block_buckets=(SHORT_AREA,), compiled=compiled,
                           state_sharding=jax.sharding.SingleDeviceSharding(dev),
                           progress=False)
        sched = Scheduler(SchedulerConfig(num_slots=args.slots, policy="fcfs-static"), latency)
        engines.append(Engine(runner, sched, name=f"instance-{i}"))

    def run(which: list[int]) -> tuple[float, StepTimeline]:
        timeline = StepTimeline()
        for i in which:
            engines[i].add_step_hook(timeline)
        start = time.monotonic()
        handles = []
        for i in which:
            for j, p in enumerate(problems):
                now = time.monotonic()
                req = Request(f"{i}-{j}-{start}", tuple(model.tokenizer.encode(p.prompt)), TASKS[p.task].gen_length,
                              task_block(TASKS[p.task].gen_length), now, now + 3600.0, tau_min=0.9, tau_max=0.9)
                handles.append(engines[i].submit(req))
        for h in handles:
            h.result(600)
        elapsed = time.monotonic() - start
        for i in which:
            engines[i].remove_step_hook(timeline)
        return elapsed, timeline

    for e in engines:
        e.start()
    try:
        run([0, 1])  # warm both (first calls of each executable on each device)
        alone = [run([i])[0] for i in (0, 1)]
        both, timeline = run([0, 1])
    finally:
        for e in engines:
            e.stop()
    busy = [timeline.busy(f"instance-{i}") for i in (0, 1)]
    overlap = timeline.overlap("instance-0", "instance-1")
    row = {"serial_s": round(sum(alone), 3), "concurrent_s": round(both, 3),
           "speedup": round(sum(alone) / both, 2), "busy_s": [round(b, 3) for b in busy],
           "overlap_s": round(overlap, 3), "overlap_fraction_of_busy": round(overlap / min(busy), 3),
           "cpu_count": os.cpu_count(), "backend": jax.default_backend()}
    if args.json:
        print(json.dumps(row))
    else:
        print(f"two instances, {args.requests} requests each, {args.slots} slots, backend {row['backend']} "
              f"({row['cpu_count']} host cores)")
        print(f"  one after the other : {row['serial_s']:.2f} s")
        print(f"  concurrently        : {row['concurrent_s']:.2f} s  (speed-up {row['speedup']:.2f}x)")
        print(f"  both inside a step  : {row['overlap_s']:.2f} s = {100 * row['overlap_fraction_of_busy']:.0f}% "
              f"of the less busy instance's step time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
