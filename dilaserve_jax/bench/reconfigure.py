"""`python -m dilaserve_jax.bench.reconfigure`: what a layout switch costs, phase by phase.

Serves the embedded tiny model on 8 fake CPU devices and keeps a steady load of requests in flight
while the layout goes 2x4 -> 8x1 -> 4+2+1+1 -> 1x8 -> 2x4, twice: the first pass compiles every new
placement ("cold"), the second finds them all compiled ("warm"). For each switch it reports the
phases (building the new instances beside the old ones: reshard + engines + warm-up; reaching a
step boundary and handing over; re-admission; first step of the moved requests on their new
instance), the bytes moved, how many requests moved, executables compiled, and the pause requests
in flight saw: the gap between two of a request's steps across the switch (p50/p99 over moved
requests). Then the controller's decision time for 8-64 devices (pure Python; synthetic profile).

Fake CPU devices share this machine's cores, so TP speed-ups cannot show here: these are the
mechanism's costs. The performance case for the controller is made in the simulator.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass

from dilaserve_jax.core.cli import (add_config_arguments, config_from_args, opt, returns_exit_status,
                                    setup_logging, words)
from dilaserve_jax.core.kinds import CACHE_MODES

log = logging.getLogger(__name__)
SEQUENCE = ("8x1", "4+2+1+1", "1x8", "2x4")


@dataclass(frozen=True, slots=True)
class ReconfigureConfig:
    sequence: tuple[str, ...] = opt(SEQUENCE, "comma-separated layouts after the initial 2x4", parse=words,
                                    default_text=",".join(SEQUENCE))
    passes: int = opt(2, "times through the sequence (2: cold, then warm)")
    in_flight: int = opt(16, "requests kept in flight")
    cache: str = opt("dual", "KV cache mode", aliases=("--cache-mode",), choices=CACHE_MODES)
    slots: int = opt(4, "slots per instance")
    json: bool = opt(False, "print one JSON object")

    def __post_init__(self):
        if not self.sequence or min(self.passes, self.in_flight, self.slots) < 1:
            raise ValueError("need a --sequence and positive --passes, --in-flight and --slots")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dilaserve_jax.bench.reconfigure",
                                description="Measure the phases, bytes and request pauses of live layout switches "
                                            "on the tiny model (8 fake CPU devices), and the controller's decision "
                                            "time for 8-64 devices.")
    return add_config_arguments(p, ReconfigureConfig)


@returns_exit_status
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = config_from_args(ReconfigureConfig, parser.parse_args(argv), parser)
    setup_logging(log)
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    switches = _measure_switches(args)
    decisions = _decision_times()
    if args.json:
        print(json.dumps({"switches": switches, "decision_seconds": decisions}))
        return 0
    print(f"{'pass':5s} {'switch':18s} {'mode':8s} {'build s':>8s} {'reshard s':>9s} {'boundary s':>10s} "
          f"{'readmit s':>9s} {'1st step s':>10s} {'total s':>8s} {'MiB':>6s} {'moved':>5s} {'exes':>5s} "
          f"{'pause p50':>9s} {'p99 s':>6s}")
    for s in switches:
        print(f"{s['pass']:5s} {s['switch']:18s} {s['mode']:8s} {s['build_s']:8.2f} {s['reshard_s']:9.3f} "
              f"{s['boundary_s']:10.3f} {s['readmit_s']:9.3f} {_f(s['first_step_s'], 10)} {s['total_s']:8.2f} "
              f"{s['bytes_moved'] / 2**20:6.1f} {s['requests_moved']:5d} {s['compiled']:5d} "
              f"{_f(s['pause_p50_s'], 9)} {_f(s['pause_p99_s'], 6)}")
    print("\ncontroller decision time (pure Python, synthetic profile):")
    for n, (cands, secs) in decisions.items():
        print(f"  {n:3d} devices: {cands:5d} candidate layouts, {secs * 1e3:7.1f} ms")
    return 0


def _f(x, width: int) -> str:
    return f"{x:{width}.3f}" if x is not None else f"{'n/a':>{width}s}"


def _measure_switches(args) -> list[dict]:
    from tqdm.auto import tqdm

    from dilaserve_jax.serving.executor.build import ServeConfig, build_cluster
    from dilaserve_jax.serving.cluster.fake_runner import fake_tp_profile
    from dilaserve_jax.serving.policy.request import Request
    from dilaserve_jax.tasks.suite import unique_problems

    import tempfile
    profile = os.path.join(tempfile.mkdtemp(prefix="dilaserve-reconfigure-"), "profile.json")
    fake_tp_profile((1, 2, 4, 8)).save(profile)  # only orders the queue here; the switch costs are measured
    cfg = ServeConfig(model="tiny", mesh="2x4", slots=args.slots, length_buckets=(64,), block_buckets=(16,),
                      default_block_length=16, profile=profile, cache_mode=args.cache, controller="manual")
    cluster = build_cluster(cfg, say=log.info)
    cluster.start()
    cluster.warm_up()
    tok = cluster.tokenizer
    prompts = [p.prompt for n in ("sort", "repeat") for p in unique_problems(n, "heldout", 30, seed=4)]
    steps: dict[str, list[tuple[float, str]]] = {}  # request -> (time, instance) of each step
    lock, stop, counter = threading.Lock(), threading.Event(), [0]

    def on_step(rid):
        def cb(p):
            with lock:
                steps.setdefault(rid, []).append((p.time, p.instance))
        return cb

    def keep_busy():
        handles = []
        while not stop.is_set():
            handles = [h for h in handles if not h.done()]
            while len(handles) < args.in_flight:
                counter[0] += 1
                now = time.monotonic()
                rid = f"r{counter[0]}"
                req = Request(rid, tuple(tok.encode(prompts[counter[0] % len(prompts)])), 16, 16, now, now + 600,
                              tau_min=0.9, tau_max=1.0)
                handles.append(cluster.submit(req, on_step(rid)))
            time.sleep(0.002)
        for h in handles:
            h.result(600)

    loader = threading.Thread(target=keep_busy, daemon=True)
    loader.start()
    out = []
    sequence = list(args.sequence)
    bar = tqdm(total=len(sequence) * args.passes, desc="switches", file=sys.stderr)
    for k in range(args.passes):
        for spec in sequence:
            time.sleep(0.5)  # steady state before the switch
            old = cluster.layout
            t_start = time.monotonic()
            report = cluster.reconfigure(spec, reason="benchmark")
            t_end = time.monotonic()
            time.sleep(0.5)  # let moved requests take their next steps
            with lock:
                histories = [list(s) for s in steps.values()]
            gaps, firsts = [], []  # a request that changed instance during this switch
            for s in histories:
                for (ta, ia), (tb, ib) in zip(s, s[1:]):
                    if ia != ib and tb >= t_start:
                        gaps.append(tb - ta)
                        firsts.append(tb - t_end)
            gaps.sort()
            out.append({"pass": "cold" if k == 0 else "warm", "switch": f"{old} -> {spec}", "mode": report.mode,
                        "build_s": report.build_s, "reshard_s": report.reshard_s, "boundary_s": report.boundary_s,
                        "readmit_s": report.readmit_s, "first_step_s": max(firsts) if firsts else None,
                        "total_s": report.total_s, "bytes_moved": report.bytes_moved,
                        "requests_moved": report.requests_moved, "compiled": report.compiled,
                        "pause_p50_s": statistics.median(gaps) if gaps else None,
                        "pause_p99_s": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else None})
            bar.update(1)
    bar.close()
    stop.set()
    loader.join(600)
    cluster.stop()
    return out


def _decision_times() -> dict[int, tuple[int, float]]:
    from dilaserve_jax.serving.policy.capacity import RequestShape
    from dilaserve_jax.serving.policy.controller import ClusterController, ControllerConfig
    from dilaserve_jax.serving.cluster.fake_runner import fake_tp_profile
    from dilaserve_jax.serving.policy.latency import LatencyModel

    tps = (1, 2, 4, 8, 16, 32, 64)
    latency = LatencyModel.from_profile(fake_tp_profile(tps))
    out = {}
    for n in (8, 16, 32, 64):
        ctl = ClusterController(ControllerConfig(), num_devices=n, tp_degrees=[t for t in tps if t <= n],
                                latency=latency, slots=8, param_bytes=16 * 10**9)
        for i in range(64):
            ctl.observe(RequestShape(32 + i % 64, 64 * (1 + i % 3), 32, 0.5 + (i % 5) * 0.5), i * 0.05)
        t = time.perf_counter()
        ctl.decide(3.2, (1,) * n)
        out[n] = (len(ctl.candidates), time.perf_counter() - t)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
