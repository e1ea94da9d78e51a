"""`python -m dilaserve_jax.bench.push`: what pushing weights from a training job costs its thread.

Params of a model, sharded FSDP-style over devices 0-3 as a training job holds them, are placed
into a serving instance on devices 4-5 (TP 2) two ways, interleaved: a `TransferPlan` (a handful of
calls for the whole tree) and `mesh.place_params` (one `move` per array, hundreds of small calls).
It times how long the calling thread is busy -- the part of `Server.update_weights` a training loop
waits for -- with the process idle and with N Python threads spinning beside it (as serving
engines and gRPC workers do), then checks both results are bit-identical.

With --collectives it also times a small TP-2 program (one all-reduce) on devices 4-5 alone and
beside a program with collectives running in a loop on devices 0-3: on XLA's CPU backend the
second number shows whether collectives of unrelated device groups wait for each other.
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from dataclasses import dataclass

from dilaserve_jax.core.cli import add_config_arguments, config_from_args, opt, returns_exit_status


@dataclass(frozen=True, slots=True)
class PushConfig:
    model: str = opt("tiny", "preset or checkpoint")
    busy_threads: int = opt(4, "Python threads spinning beside the push")
    repeats: int = opt(3, "timed pushes per method and condition")
    collectives: bool = opt(False, "also time a TP-2 program beside a collective-heavy one")
    json: bool = opt(False, "print one JSON object instead of the table")

    def __post_init__(self):
        if self.repeats < 1 or self.busy_threads < 0:
            raise ValueError("need repeats >= 1 and busy-threads >= 0")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dilaserve_jax.bench.push",
                                description="Time the calling thread's share of a weight push (TransferPlan vs "
                                            "per-array place_params), idle and beside busy threads; optionally "
                                            "whether collectives of disjoint device groups wait for each other.")
    return add_config_arguments(p, PushConfig)


@returns_exit_status
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = config_from_args(PushConfig, parser.parse_args(argv), parser)
    from dilaserve_jax.serve import present_cpu_devices

    present_cpu_devices("8", 1)
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        for cond in ("idle", "busy"):
            row = result[cond]
            print(f"{cond:5} ({result['busy_threads'] if cond == 'busy' else 0} busy threads): TransferPlan "
                  f"{_ms(row['plan'])}  vs  place_params {_ms(row['per_array'])}  (ms on the calling thread, "
                  f"median of {args.repeats})")
        print(f"first TransferPlan call (builds and compiles its cut/join calls): {result['plan_first_ms']:.0f} ms; "
              f"results bit-identical: {result['identical']}")
        if "collectives" in result:
            c = result["collectives"]
            print(f"TP-2 all-reduce program on devices 4-5: {c['alone_ms']:.2f} ms alone, {c['beside_ms']:.1f} ms "
                  f"beside a collective program looping on devices 0-3 (one of which takes {c['heavy_ms']:.0f} ms)")
    return 0


def _ms(values) -> str:
    return f"{statistics.median(values):7.1f} [" + ", ".join(f"{v:.0f}" for v in values) + "]"


def _spinning(n: int):
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            sum(range(1000))

    threads = [threading.Thread(target=spin, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return stop, threads


def run(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from dilaserve_jax.mesh import Layout, param_shardings, place_params
    from dilaserve_jax.mesh.transfer import TransferPlan
    from dilaserve_jax.models import load_model

    model = load_model(args.model)
    cfg = model.config
    mesh = Mesh(np.array(jax.devices()[:4]), ("fsdp",))
    params = jax.tree.map(lambda x: x.astype(jnp.float32), model.params)
    params = jax.device_put(params, jax.tree.map(
        lambda x: NamedSharding(mesh, P("fsdp") if x.shape[0] % 4 == 0 else P()), params))
    inst = Layout.build("1x2", devices=jax.devices()[4:6], config=cfg).instances[0]
    leaves = jax.tree.leaves(params)
    targets = jax.tree.leaves(param_shardings(params, inst, cfg))
    plan = TransferPlan([(x.shape, x.dtype, x.sharding) for x in leaves], targets)
    t = time.perf_counter()
    jax.block_until_ready(plan(leaves))
    first_ms = (time.perf_counter() - t) * 1e3
    jax.block_until_ready(place_params(params, inst, cfg))  # its small calls compile once too

    def timed(fn) -> float:
        t0 = time.perf_counter()
        out = fn()
        ms = (time.perf_counter() - t0) * 1e3
        jax.block_until_ready(out)
        return ms

    result = {"model": args.model, "busy_threads": args.busy_threads, "plan_first_ms": first_ms}
    for cond in ("idle", "busy"):
        stop, threads = _spinning(args.busy_threads if cond == "busy" else 0)
        row = {"plan": [], "per_array": []}
        for _ in range(args.repeats):  # interleaved
            row["plan"].append(timed(lambda: plan(leaves)))
            row["per_array"].append(timed(lambda: place_params(params, inst, cfg)))
        stop.set()
        for th in threads:
            th.join()
        result[cond] = row
    a = [np.asarray(x) for x in plan(leaves)]
    b = [np.asarray(x) for x in jax.tree.leaves(place_params(params, inst, cfg))]
    result["identical"] = all(x.tobytes() == y.tobytes() for x, y in zip(a, b))
    if args.collectives:
        result["collectives"] = _collectives(jax, jnp, np, Mesh, NamedSharding, P)
    return result


def _collectives(jax, jnp, np, Mesh, NamedSharding, P) -> dict:
    train = Mesh(np.array(jax.devices()[:4]), ("d",))
    x = jax.device_put(jnp.ones((2048, 2048)), NamedSharding(train, P("d", None)))
    w = jax.device_put(jnp.full((2048, 2048), 1e-3), NamedSharding(train, P(None, "d")))

    @jax.jit
    def heavy(x, w):  # every matmul all-gathers a sharded operand
        for _ in range(6):
            x = jnp.tanh(x @ w)
        return x.sum()

    serve = Mesh(np.array(jax.devices()[4:6]), ("m",))
    y = jax.device_put(jnp.ones((64, 256)), NamedSharding(serve, P(None, "m")))
    v = jax.device_put(jnp.ones((256, 256)), NamedSharding(serve, P("m", None)))
    light = jax.jit(lambda y, v: (y @ v).sum())  # one all-reduce over devices 4-5
    heavy(x, w).block_until_ready()
    light(y, v).block_until_ready()

    def per_call(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            light(y, v).block_until_ready()
        return (time.perf_counter() - t0) / n * 1e3

    alone = per_call(20)
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            heavy(x, w).block_until_ready()

    th = threading.Thread(target=loop, daemon=True)
    th.start()
    time.sleep(0.5)
    beside = per_call(5)
    stop.set()
    th.join()
    t0 = time.perf_counter()
    heavy(x, w).block_until_ready()
    return {"alone_ms": alone, "beside_ms": beside, "heavy_ms": (time.perf_counter() - t0) * 1e3}


if __name__ == "__main__":
    raise SystemExit(main())
