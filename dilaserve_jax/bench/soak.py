"""`python -m dilaserve_jax.bench.soak`: many calls over gRPC, with faults, and nothing may be lost.

Starts the server in this process exactly as `serve --mesh 2x4` builds it (embedded tiny model),
then sends N calls over gRPC from an asyncio client with bounded concurrency: held-out task
prompts, some cancelled by the client after a random delay, some malformed on purpose. Midway it
reloads the weights through `ReloadWeights` and makes one instance's runner raise (a device
fault), so that instance fails and its requests move to the survivors. It prints how every call
ended; "lost" counts calls that ended in any way the server does not answer by design (INTERNAL,
UNKNOWN, UNAVAILABLE, a hang) and must be 0.

`--phases 1:60,10:60,...` replaces the closed loop with open-loop Poisson arrivals whose rate changes
from phase to phase, so that a live controller (`--controller auto`) has loads to follow; the report
then lists the layout switches it made. With `--profile synthetic-tp` the controller prices layouts
with a synthetic multi-TP profile (`soak_load.synthetic_tp_profile`): on 8 fake CPU devices that share the
machine's cores a wider instance is never faster, so a measured profile gives it nothing to switch for.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from dilaserve_jax.bench.soak_load import (  # noqa: F401 - re-exported: the soak's inputs
    SYNTHETIC_TP, SYNTHETIC_TP_SCALE, parse_phases, poisson_arrivals, synthetic_tp_profile)
from dilaserve_jax.core.cli import add_config_arguments, config_from_args, opt, returns_exit_status, setup_logging, words
from dilaserve_jax.serve import DEFAULT_COMPILE_CACHE
from dilaserve_jax.serving.cluster.autoscale import MODES

log = logging.getLogger(__name__)

BAD_REQUESTS = (  # (what, GenerateRequest fields): each must come back INVALID_ARGUMENT
    ("empty prompt", {"text": ""}),
    ("tau out of range", {"text": "sort 312=", "tau_min": 1.5}),
    ("floor above ceiling", {"text": "sort 312=", "tau_min": 0.9, "tau_max": 0.5}),
    ("negative slo", {"text": "sort 312=", "slo_ms": -1.0}),
    ("answer too long", {"text": "sort 312=", "max_new_tokens": 100_000}),
    ("character outside the vocabulary", {"text": "s\u00f6rt 312="}),
    ("reserved token id", {"token_ids": [2, 65]}),
)
BY_DESIGN = {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "CANCELLED"}


@dataclass(frozen=True, slots=True)
class SoakConfig:
    requests: int = opt(10_000, "calls to send")
    concurrency: int = opt(64, "calls in flight at once")
    mesh: str = opt("2x4", "layout")
    slots: int = opt(8, "slots per instance")
    cancel_rate: float = opt(0.05, "share of calls cancelled by the client")
    bad_rate: float = opt(0.05, "share of malformed calls")
    slo_ms: float = opt(60_000.0, "slo_ms of every call")
    controller: str = opt("manual", "cluster controller of the server (manual: the soak is about faults)",
                          choices=MODES)
    layouts: tuple[str, ...] = opt((), "layouts --controller auto may choose, as serve --layouts (e.g. "
                                        "'4x2,2x4,1x8': on a few shared cores, a switch to 8 instances compiles "
                                        "for minutes)", parse=words, default_text="all")
    profile: str | None = opt(None, f"step-latency profile JSON, or '{SYNTHETIC_TP}': a synthetic multi-TP profile "
                                    "in which wide instances are faster per request and narrow ones serve more in all "
                                    "(what a GPU shows and fake CPU devices cannot), so a live controller has reason "
                                    "to switch", default_text="measured at start-up, as serve does")
    phases: tuple[tuple[float, float], ...] | None = opt(
        None, "open-loop Poisson arrivals, RATE:SECONDS per phase, e.g. 1:60,10:60,1:60,10:60 (replaces "
              "--requests and --concurrency)", parse=parse_phases, metavar="RATE:SECONDS,...", default_text="closed loop")
    fault: bool = opt(True, "inject the instance failure midway")
    reload: bool = opt(True, "reload the weights midway")
    seed: int = opt(0, "prompt, cancellation and malformation seed")
    compile_cache: str = opt(DEFAULT_COMPILE_CACHE, "persistent XLA compilation cache ('none' disables)")
    ray_workers: int = opt(0, "serve over this many worker processes (local Ray nodes, --mesh each) as "
                              "`serve --ray-address` does; the fault midway is then a SIGKILL of the last "
                              "worker, and there is no reload (not carried across hosts)")
    json: bool = opt(False, "print the report as one JSON object")
    verbose: bool = opt(False, "print the server's log at INFO too (the controller's switches among it)")

    def __post_init__(self):
        if self.requests < 1 or self.concurrency < 1 or not 0 <= self.cancel_rate < 1 or not 0 <= self.bad_rate < 1:
            raise ValueError("need requests, concurrency >= 1 and rates in [0, 1)")
        if self.ray_workers < 0:
            raise ValueError("--ray-workers must be >= 0")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dilaserve_jax.bench.soak",
                                description="Send many gRPC calls to an in-process `serve --mesh 2x4` with random "
                                            "cancellations, malformed calls, a weight reload and an injected "
                                            "instance failure midway; report how every call ended (lost must be 0).")
    return add_config_arguments(p, SoakConfig)


@returns_exit_status
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = config_from_args(SoakConfig, parser.parse_args(argv), parser)
    setup_logging(log, verbose=args.verbose)
    from dilaserve_jax.serve import present_cpu_devices

    present_cpu_devices(args.mesh, 1)
    return asyncio.run(_soak(args))


def _prompts(seed: int) -> list[tuple[str, int]]:
    from dilaserve_jax.tasks.suite import SHORT_AREA, TASKS, unique_problems

    names = [n for n, t in TASKS.items() if t.gen_length == SHORT_AREA]
    return [(p.prompt, TASKS[p.task].gen_length) for n in names for p in unique_problems(n, "heldout", 60, seed=seed)]


async def _soak(args) -> int:
    import grpc
    from tqdm.auto import tqdm

    from dilaserve_jax.decoding.compiled import enable_compile_cache
    from dilaserve_jax.frontend import dilaserve_pb2 as pb
    from dilaserve_jax.frontend import dilaserve_pb2_grpc as pb_grpc
    from dilaserve_jax.frontend.server import ServerOptions, start_server
    from dilaserve_jax.models import load_model
    from dilaserve_jax.models.checkpoint import save_params
    from dilaserve_jax.models.registry import save_model_config
    from dilaserve_jax.serving.executor.build import ServeConfig, build_cluster

    enable_compile_cache(args.compile_cache)
    root = Path(tempfile.mkdtemp(prefix="dilaserve-soak-"))
    model = load_model("tiny")
    save_model_config(root / "tiny-copy", model.config)
    save_params(root / "tiny-copy", 1, model.params)
    profile = args.profile
    if profile == SYNTHETIC_TP:
        profile = str(root / "synthetic-tp-profile.json")
        synthetic_tp_profile().save(profile)
    serve_config = ServeConfig(mesh=args.mesh, slots=args.slots, profile=profile, controller=args.controller,
                               layouts=args.layouts)
    hosts = _RayWorkers(args, serve_config) if args.ray_workers else None
    cluster = hosts.cluster if hosts is not None else build_cluster(serve_config, log.info)
    server = await start_server(cluster, ServerOptions(port=0, metrics_port=None, weights_roots=(str(root),)))
    cluster.start()
    await asyncio.to_thread(cluster.warm_up)
    await server.set_serving(True)
    arrivals = poisson_arrivals(args.phases, args.seed) if args.phases else None
    calls = len(arrivals) if arrivals is not None else args.requests
    if arrivals is not None:
        phases = ", ".join(f"{r:g}/s for {t:g} s" for r, t in args.phases)
        log.info(f"soak: {calls} calls arriving at {phases}, against {cluster.layout} on port {server.port}")
    else:
        log.info(f"soak: {calls} calls, {args.concurrency} at a time, against {cluster.layout} on port {server.port}")

    rng = random.Random(args.seed)
    prompts = _prompts(args.seed)
    outcomes: Counter = Counter()
    latencies: list[float] = []
    met = [0]  # completed calls that met their deadline
    events: list[str] = []
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    stub = pb_grpc.DiLaServeStub(channel)
    sem = asyncio.Semaphore(args.concurrency) if arrivals is None else contextlib.nullcontext()  # open loop: no bound
    bar = tqdm(total=calls, desc="soak", unit="call", file=sys.stderr)
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        kind = rng.random()
        if kind < args.bad_rate:
            what, fields = BAD_REQUESTS[i % len(BAD_REQUESTS)]
            fields = dict(fields)
            ids = fields.pop("token_ids", None)
            req = pb.GenerateRequest(**fields)
            if ids is not None:
                req.token_ids.ids.extend(ids)
            expected = "INVALID_ARGUMENT"
        else:
            text, gen = prompts[i % len(prompts)]
            req = pb.GenerateRequest(text=text, max_new_tokens=gen, block_length=gen, slo_ms=args.slo_ms,
                                     tau_min=0.9, tau_max=1.0)
            expected = None
        cancel_after = rng.uniform(0.0, 0.2) if expected is None and kind > 1 - args.cancel_rate else None
        if arrivals is not None:
            await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
        async with sem:
            sent = time.perf_counter()
            call = stub.Generate(req, timeout=600)
            try:
                if cancel_after is not None:
                    done, _ = await asyncio.wait({asyncio.ensure_future(_await(call))}, timeout=cancel_after)
                    if not done:
                        call.cancel()
                reply = await call
                outcomes["OK"] += 1
                latencies.append(time.perf_counter() - sent)
                met[0] += reply.deadline_met
                assert reply.text is not None
            except asyncio.CancelledError:
                outcomes["CANCELLED"] += 1
            except grpc.aio.AioRpcError as err:
                code = err.code().name
                if expected is not None and code != expected:
                    code = f"{code} (expected {expected})"
                outcomes[code] += 1
        bar.update(1)

    async def faults() -> None:
        while bar.n < calls // 2:
            await asyncio.sleep(0.05)
        if hosts is not None:
            events.append(f"SIGKILLed the worker of host {hosts.kill_last()} at call {bar.n}")
            return
        if args.reload:
            t = time.perf_counter()
            reply = await _reload_when_free(stub, pb.ReloadWeightsRequest(directory=str(root / "tiny-copy")))
            events.append(f"reloaded {reply.model} in {time.perf_counter() - t:.2f} s at call {bar.n}")
        if args.fault:
            victim = cluster.engines[0]
            real_step = victim.runner.step

            def faulty(*args, **kwargs):
                victim.runner.step = real_step
                raise RuntimeError("injected device fault")
            victim.runner.step = faulty
            events.append(f"injected a fault into {victim.name} at call {bar.n}")

    switches: list[str] = []

    async def watch_layout() -> None:
        """Every layout the cluster takes, with when (a switch takes seconds; 0.2 s polls see each)."""
        last = cluster.layout
        while True:
            await asyncio.sleep(0.2)
            now = cluster.layout
            if now != last:
                switches.append(f"{last} -> {now} at {time.perf_counter() - t0:.0f} s")
                last = now

    fault_task = asyncio.ensure_future(faults())
    watch_task = asyncio.ensure_future(watch_layout())
    await asyncio.gather(*(one(i) for i in range(calls)))
    wall = time.perf_counter() - t0
    bar.close()
    for task in (fault_task, watch_task):
        if not task.done():
            task.cancel()
    if fault_task.done() and not fault_task.cancelled() and fault_task.exception() is not None:
        err = fault_task.exception()  # the reload or the fault midway failed: say so in the report
        why = err.details() if isinstance(err, grpc.aio.AioRpcError) else err
        events.append(f"the fault midway failed: {type(err).__name__}: {why}")
    state = cluster.state()
    await channel.close()
    await server.drain_and_stop(5.0)
    cluster.stop()
    if hosts is not None:
        hosts.stop()
    shutil.rmtree(root, ignore_errors=True)

    lost = sum(n for code, n in outcomes.items() if code not in BY_DESIGN and code != "OK")
    lat = sorted(latencies)
    report = {
        "calls": calls, "completed": outcomes["OK"],
        "rejected_by_design": outcomes["INVALID_ARGUMENT"] + outcomes["RESOURCE_EXHAUSTED"],
        "cancelled": outcomes["CANCELLED"], "lost": lost, "outcomes": dict(outcomes),
        "met_deadline": met[0], "p50_latency_s": statistics.median(lat) if lat else None,
        "p99_latency_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None,
        "wall_s": wall, "events": events, "failures": dict(state.failures), "migrations": dict(state.migrations),
        "reloads": state.reloads, "layout": state.layout, "layout_switches": switches,
        "rebuilt": [list(x) for x in cluster.recovery.done],
    }
    if args.json:
        print(json.dumps(report))
    else:
        for e in events:
            print(e)
        for name, outcome in cluster.recovery.done:
            print(f"failed instance {name}: {outcome}")
        if args.verbose:
            for d in state.controller.decisions:
                print(f"controller decision: {d}")
        if arrivals is not None:
            print(f"deadline met by {met[0]} of {outcomes['OK']} completed calls ({args.slo_ms:g} ms each)")
        if args.controller != "manual" or switches:
            print(f"layout switches: {len(switches)}" + (f" ({'; '.join(switches)})" if switches else ""))
        print(f"calls {report['calls']}, completed {report['completed']}, rejected by design "
              f"{report['rejected_by_design']}, cancelled {report['cancelled']}, lost {lost}; latency p50 "
              f"{_ms(report['p50_latency_s'])}, p99 {_ms(report['p99_latency_s'])}; {wall:.0f} s "
              f"({report['calls'] / wall:.1f} calls/s); moved by failure: {state.migrations.get('failure', 0)}")
        if lost:
            print("lost calls by status: " + ", ".join(f"{k}: {v}" for k, v in outcomes.items()
                                                       if k not in BY_DESIGN and k != "OK"))
    return 1 if lost else 0


class _RayWorkers:
    """A local Ray cluster of `ray_workers` nodes, one serving worker on each (bench only)."""

    def __init__(self, args, serve_config) -> None:
        import ray
        from ray.cluster_utils import Cluster as RayCluster

        from dilaserve_jax.mesh.spec import MeshSpec
        from dilaserve_jax.serving.cluster.hosts.ray_hosts import RayHosts
        from dilaserve_jax.serving.executor.hosts import ExecutorHostFactory

        self.nodes = RayCluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                                      "object_store_memory": 200 * 2**20})
        for _ in range(args.ray_workers - 1):
            self.nodes.add_node(num_cpus=1, object_store_memory=200 * 2**20)
        ray.init(address=self.nodes.address, log_to_driver=False)
        devices = MeshSpec.parse(args.mesh).num_devices
        self.hosts = RayHosts(ExecutorHostFactory(serve_config, args.compile_cache), say=log.info,
                              env_vars={"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"})
        log.info(f"soak: starting {args.ray_workers} worker process(es), each compiling {args.mesh}")
        self.cluster = self.hosts.start(step_timeout_s=None)

    def kill_last(self) -> str:
        import os
        import signal

        import ray

        node = list(self.hosts.links)[-1]
        os.kill(ray.get(self.hosts.actors[node].pid.remote()), signal.SIGKILL)
        return self.hosts.links[node].host

    def stop(self) -> None:
        import ray

        self.hosts.stop()
        ray.shutdown()
        self.nodes.shutdown()


async def _reload_when_free(stub, request, patience_s: float = 600.0):
    """ReloadWeights, waiting out a layout switch in progress (the server refuses a reload during a
    reconfiguration with FAILED_PRECONDITION) for up to `patience_s`."""
    import grpc

    t = time.perf_counter()
    while True:
        try:
            return await stub.ReloadWeights(request, timeout=patience_s)
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.FAILED_PRECONDITION or time.perf_counter() - t > patience_s:
                raise
            await asyncio.sleep(1.0)


async def _await(call):
    try:
        return await call
    except BaseException:  # noqa: BLE001 - the main waiter reports it
        return None


def _ms(seconds) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.0f} ms"


if __name__ == "__main__":
    raise SystemExit(main())
