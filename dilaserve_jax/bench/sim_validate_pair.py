"""`bench.sim_validate --instances N`: the simulator against N real instances behind the real router.

The real side: the tiny model on N instances of TP 1, one device each (on CPU, N host devices:
`prepare_devices` sets XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX is imported),
each a real `Engine` on its own engine thread, pinned to its own core (`pin_to_core`, run on the
engine thread through `Engine.call`), all in the real `serving.cluster.Cluster`, so every request
is placed by the serving `Router` (`RequestTable`), exactly as `serve` places it. Arrivals are
submitted on the caller's thread at their trace times (real clock). The instances share the
start-up profile of the first one (`Bench.build`; the devices are alike), and each pool prompt's
idle latency is the one instance's (`Bench.capacity`); the capacity the load factors multiply is
measured through the N instances (saturating fcfs-static work, `4 × slots × N` requests).

The simulated side is `sim_validate`'s (`compare_with_sim`) with N modelled instances (layout
`Nx1`) behind the same router code (`sim/cluster.py`); step times per shape and their slowdown over
time are pooled over the N instances' steps; the host-time fit uses each instance's iterations.
Each row also has where the requests went (`placed`: per instance, real and simulated).

What the pinning does not do: XLA's CPU client runs the compiled computations on its own thread
pool, shared by all host devices, so pinning an engine thread pins its Python work (scheduling,
dispatch, copies) and not the matrix work, and the N instances still contend for the same cores.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from concurrent.futures import wait

log = logging.getLogger("dilaserve_jax.bench.sim_validate")

FORCE_DEVICES = "--xla_force_host_platform_device_count"


def usable_cores() -> list[int]:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def check_instances(n: int) -> list[int]:
    """The core each of `n` instances is pinned to; ValueError if there are fewer cores than instances."""
    cores = usable_cores()
    if n < 1:
        raise ValueError(f"--instances must be at least 1, got {n}")
    if n > len(cores):
        raise ValueError(f"--instances {n}: each instance's engine thread is pinned to its own core, and this "
                         f"process may run on {len(cores)} core(s) ({', '.join(map(str, cores))})")
    return cores[:n]


def prepare_devices(n: int) -> None:
    """Ask XLA for `n` host devices, if JAX is not imported yet and nobody asked for a count already."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "jax" not in sys.modules and FORCE_DEVICES not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {FORCE_DEVICES}={n}".strip()


def devices_for(n: int) -> list:
    """The first `n` local devices; ValueError naming the fix if JAX has fewer."""
    import jax

    devices = jax.local_devices()
    if len(devices) < n:
        raise ValueError(f"--instances {n} needs {n} devices; JAX sees {len(devices)} {devices[0].platform} "
                         f"device(s). On CPU, set XLA_FLAGS={FORCE_DEVICES}={n} before JAX is imported (this "
                         f"command sets it itself unless XLA_FLAGS already gives a count or JAX was imported)")
    return devices[:n]


def pin_to_core(core: int) -> str:
    """Pin the calling thread (its native id) to `core`; what was done, for the log."""
    if not hasattr(os, "sched_setaffinity"):
        return "not pinned (no sched_setaffinity on this OS)"
    tid = threading.get_native_id()
    try:
        os.sched_setaffinity(tid, {core})
    except OSError as err:
        return f"not pinned ({err})"
    return f"thread {tid} pinned to core {sorted(os.sched_getaffinity(tid))}"


class Instances:
    """N runners of the benchmark's model, one per device (the first is the benchmark's own, profiled one)."""

    def __init__(self, bench, devices, cores) -> None:
        from dilaserve_jax.core.layouts import instance_name
        from dilaserve_jax.mesh import Instance, place_params
        from dilaserve_jax.serving.cluster.builder import InstanceInfo
        from dilaserve_jax.serving.executor.instances import state_sharding
        from dilaserve_jax.serving.executor.runner import JaxRunner

        self.bench, self.cores = bench, list(cores)
        if bench.runner.decoder.devices != frozenset({devices[0]}):
            raise RuntimeError(f"the profiled runner is on {bench.runner.decoder.devices}, not on {devices[0]}")
        m, dc = bench.model, bench.runner.decoder.config
        self.runners = [bench.runner]
        t0 = time.perf_counter()
        for d in devices[1:]:
            inst = Instance.over(d.id, [d])
            runner = JaxRunner(m.config, m.graphdef, place_params(m.params, inst, m.config), num_slots=dc.num_slots,
                               length_buckets=dc.length_buckets, block_buckets=dc.block_buckets, tp_degree=1,
                               state_sharding=state_sharding(inst, m.config, True), warm_up=False, progress=False)
            runner.warm_up(progress=False)
            self.runners.append(runner)
        self.infos = [InstanceInfo(instance_name((d.id,)), 1, (d.id,)) for d in devices]
        log.info(f"{len(devices)} instances ({', '.join(i.name for i in self.infos)}); the others compiled in "
                 f"{time.perf_counter() - t0:.1f} s")

    def cluster(self, policy: str, budget: float | None, mode: str):
        """A fresh cluster (fresh schedulers) over the runners, as `Bench.serve` builds its one instance."""
        from dilaserve_jax.serving.cluster.cluster import Cluster
        from dilaserve_jax.serving.cluster.engine import Engine
        from dilaserve_jax.serving.cluster.iteration_trace import IterationTracer
        from dilaserve_jax.serving.policy.scheduler import Scheduler, SchedulerConfig

        b, cfg = self.bench, self.bench.cfg
        engines = []
        for runner, info in zip(self.runners, self.infos):
            sched_cfg = SchedulerConfig(cfg.slots, policy=policy, static_tau=cfg.static_tau, max_queue=10_000,
                                        admission=cfg.admission if policy == "dilaserve" else "best-effort",
                                        threshold=b.threshold_config(budget, mode))
            engine = Engine(runner, Scheduler(sched_cfg, b.latency), name=info.name)
            engine.tracer = IterationTracer(engine.clock)
            engines.append(engine)
        return Cluster(engines, self.infos, layout=f"{len(engines)}x1", policy=policy, model_source=b.model.source,
                       tokenizer=b.model.tokenizer, limits=None, step_timeout_s=None)

    def serve(self, policy: str, trace: list, desc: str = "", budget: float | None = None,
              mode: str = "adaptive") -> dict:
        """Serve (arrival offset, item index, slo) on the N instances, placed by the router, in real time."""
        from dilaserve_jax.serving.policy.request import make_request

        b, cfg = self.bench, self.bench.cfg
        cluster = self.cluster(policy, budget, mode)
        shapes: dict[str, tuple[int, int]] = {}  # request id -> (canvas, block)
        steps: dict[str, list] = {e.name: [] for e in cluster.engines}
        cluster.add_step_hook(lambda name, plan, outs, t0, t1: steps[name].append(
            (int(plan.kind), [shapes[r] for r in plan.request_ids], t0, t1)))
        cluster.start()
        pinned = [e.call(lambda c=core: pin_to_core(c)).result() for e, core in zip(cluster.engines, self.cores)]
        cluster.warm_up()  # nothing to compile: marks the cluster ready
        reqs, handles = [], []
        t0 = time.monotonic()
        try:
            for n, (offset, i, slo) in enumerate(trace):
                time.sleep(max(0.0, t0 + offset - time.monotonic()))
                it = b.items[i]
                r = make_request(f"q{n}", it.tokens, it.answer, it.block, t0 + offset, slo,
                                 tau_min=cfg.tau_min, tau_max=cfg.tau_max)
                shapes[r.id] = (len(it.tokens) + it.answer, it.block)
                reqs.append(r)
                handles.append(cluster.submit(r))
            wait([h.future for h in handles])
        finally:
            cluster.stop()
        for e in cluster.engines:  # flush the last releases: the runners' slots are free for the next run
            while e.step_once():
                pass
        records = b.records(reqs)
        for rec, h in zip(records, handles):
            rec["instance"] = h.result().instance if h.future.exception() is None else ""
        traces = {e.name: e.tracer.records for e in cluster.engines}
        all_steps = sorted((s for v in steps.values() for s in v), key=lambda s: s[2])
        busy = sum(r.end - r.start for recs in traces.values() for r in recs)
        step_s = sum(t1 - t0 for _, _, t0, t1 in all_steps)
        log.debug(f"{desc}: {'; '.join(f'{e.name} {p}' for e, p in zip(cluster.engines, pinned))}")
        return {"records": records, "steps": all_steps, "busy_wall_s": busy,
                "overhead_ms": 1e3 * (busy - step_s) / max(1, len(all_steps)),
                "steps_by_instance": {k: len(v) for k, v in steps.items()}, "pinned": pinned,
                "iterations_by_instance": {k: [r.to_json() for r in v] for k, v in traces.items()}}

    def capacity(self) -> float:
        """Saturated throughput (req/s) of the N instances on the workload's mix, at the static τ."""
        b = self.bench
        work = [(0.0, i, 1e9) for i in b.workload.capacity_items(4 * b.cfg.slots * len(self.runners))]
        recs = self.serve("fcfs-static", work, "capacity", None, "-")["records"]
        return len(recs) / (max(r["finish"] for r in recs) - min(r["arrival"] for r in recs))


def measure_pair(cfg) -> dict:
    """The real side on `cfg.instances` instances (JAX): everything the simulated side is fed."""
    from dilaserve_jax.bench.sim_validate import measured_json, open_bench, sweep

    cores = check_instances(cfg.instances)
    prepare_devices(cfg.instances)
    t_start = time.perf_counter()
    devices = devices_for(cfg.instances)
    bench = open_bench(cfg)
    idle, one = bench.capacity()
    inst = Instances(bench, devices, cores)
    cap = inst.capacity()
    log.info(f"capacity at τ={bench.cfg.static_tau}: {cap:.2f} req/s on {cfg.instances} instances "
             f"({one:.2f} on one); idle latency mean {1e3 * sum(idle) / len(idle):.0f} ms")
    runs = sweep(cfg, bench, cap, idle, inst.serve)
    return measured_json(cfg, bench, cap, runs, t_start, instances=cfg.instances, capacity_one_rps=one,
                         instance_names=[i.name for i in inst.infos], cores=cores,
                         pinned=runs[0]["pinned"] if runs else [])


def format_placed(rows: list[dict]) -> str:
    """Per run: requests per instance, real (the router's placements) and simulated."""
    names = sorted({k for r in rows for k in (*r["placed"]["real"], *r["placed"]["sim"])})
    head = f"{'policy':<12}{'req/s':>7}{'pass':>5} | " + " | ".join(f"{n + ' real':>12}{'sim':>7}" for n in names)
    lines = ["requests per instance", head, "-" * len(head)]
    for r in rows:
        real, sim = r["placed"]["real"], r["placed"]["sim"]
        lines.append(f"{r['policy']:<12}{r['rate']:>7.2f}{r['repeat'] + 1:>5} | "
                     + " | ".join(f"{real.get(n, 0):>12}{sim.get(n, 0.0):>7.1f}" for n in names))
    return "\n".join(lines)


def met_per_policy(points: list[dict]) -> str:
    """'N of M' points met, per policy and in all."""
    by: dict[str, list[bool]] = {}
    for p in points:
        by.setdefault(p["policy"], []).append(p["compare"]["within"])
    parts = [f"{p} {sum(v)} of {len(v)}" for p, v in sorted(by.items())]
    total = [w for v in by.values() for w in v]
    return f"met: {', '.join(parts)}; {sum(total)} of {len(total)} in all"
