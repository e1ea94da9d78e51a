"""`python -m dilaserve_jax.bench.soak`: many calls over gRPC, with faults, and nothing may be lost.

Starts the server in this process exactly as `serve --mesh 2x4` builds it (embedded tiny model),
then sends N calls over gRPC from an asyncio client with bounded concurrency: held-out task
prompts, some cancelled by the client after a random delay, some malformed on purpose. Midway it
reloads the weights through `ReloadWeights` and makes one instance's runner raise (a device
fault), so that instance fails and its requests move to the survivors. It prints how every call
ended; "lost" counts calls that ended in any way the server does not answer by design (INTERNAL,
UNKNOWN, UNAVAILABLE, a hang) and must be 0.
"""
from __future__ import annotations

import argparse
import asyncio
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

from dilaserve_jax.core.cli import add_config_arguments, config_from_args, opt, returns_exit_status, setup_logging
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
    profile: str | None = opt(None, "step-latency profile JSON", default_text="measured at start-up, as serve does")
    fault: bool = opt(True, "inject the instance failure midway")
    reload: bool = opt(True, "reload the weights midway")
    seed: int = opt(0, "prompt, cancellation and malformation seed")
    compile_cache: str = opt(DEFAULT_COMPILE_CACHE, "persistent XLA compilation cache ('none' disables)")
    ray_workers: int = opt(0, "serve over this many worker processes (local Ray nodes, --mesh each) as "
                              "`serve --ray-address` does; the fault midway is then a SIGKILL of the last "
                              "worker, and there is no reload (not carried across hosts)")
    json: bool = opt(False, "print the report as one JSON object")

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
    setup_logging(log)
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
    serve_config = ServeConfig(mesh=args.mesh, slots=args.slots, profile=args.profile, controller=args.controller)
    hosts = _RayWorkers(args, serve_config) if args.ray_workers else None
    cluster = hosts.cluster if hosts is not None else build_cluster(serve_config, log.info)
    server = await start_server(cluster, ServerOptions(port=0, metrics_port=None, weights_roots=(str(root),)))
    cluster.start()
    await asyncio.to_thread(cluster.warm_up)
    await server.set_serving(True)
    log.info(f"soak: {args.requests} calls, {args.concurrency} at a time, against {cluster.layout} on port {server.port}")

    rng = random.Random(args.seed)
    prompts = _prompts(args.seed)
    outcomes: Counter = Counter()
    latencies: list[float] = []
    events: list[str] = []
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    stub = pb_grpc.DiLaServeStub(channel)
    sem = asyncio.Semaphore(args.concurrency)
    bar = tqdm(total=args.requests, desc="soak", unit="call", file=sys.stderr)

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
        async with sem:
            t0 = time.perf_counter()
            call = stub.Generate(req, timeout=600)
            try:
                if cancel_after is not None:
                    done, _ = await asyncio.wait({asyncio.ensure_future(_await(call))}, timeout=cancel_after)
                    if not done:
                        call.cancel()
                reply = await call
                outcomes["OK"] += 1
                latencies.append(time.perf_counter() - t0)
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
        while bar.n < args.requests // 2:
            await asyncio.sleep(0.05)
        if hosts is not None:
            events.append(f"SIGKILLed the worker of host {hosts.kill_last()} at call {bar.n}")
            return
        if args.reload:
            t = time.perf_counter()
            reply = await stub.ReloadWeights(pb.ReloadWeightsRequest(directory=str(root / "tiny-copy")), timeout=600)
            events.append(f"reloaded {reply.model} in {time.perf_counter() - t:.2f} s at call {bar.n}")
        if args.fault:
            victim = cluster.engines[0]
            real_step = victim.runner.step

            def faulty(kind, slots, taus):
                victim.runner.step = real_step
                raise RuntimeError("injected device fault")
            victim.runner.step = faulty
            events.append(f"injected a fault into {victim.name} at call {bar.n}")

    t0 = time.perf_counter()
    fault_task = asyncio.ensure_future(faults())
    await asyncio.gather(*(one(i) for i in range(args.requests)))
    wall = time.perf_counter() - t0
    bar.close()
    if not fault_task.done():
        fault_task.cancel()
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
        "calls": args.requests, "completed": outcomes["OK"],
        "rejected_by_design": outcomes["INVALID_ARGUMENT"] + outcomes["RESOURCE_EXHAUSTED"],
        "cancelled": outcomes["CANCELLED"], "lost": lost, "outcomes": dict(outcomes),
        "p50_latency_s": statistics.median(lat) if lat else None,
        "p99_latency_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None,
        "wall_s": wall, "events": events, "failures": dict(state.failures), "migrations": dict(state.migrations),
        "reloads": state.reloads, "layout": state.layout,
    }
    if args.json:
        print(json.dumps(report))
    else:
        for e in events:
            print(e)
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


async def _await(call):
    try:
        return await call
    except BaseException:  # noqa: BLE001 - the main waiter reports it
        return None


def _ms(seconds) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.0f} ms"


if __name__ == "__main__":
    raise SystemExit(main())
