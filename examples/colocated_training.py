"""Train the tiny model on 4 devices while serving it from the other 4, pushing weights in memory.

    python examples/colocated_training.py        # 8 fake CPU devices; a few minutes on a 2-core CPU

The model starts as a deliberately weakened copy of the shipped tiny model (each weight matrix
gets Gaussian noise as large as its own spread), so the recovery is visible. Training: AdamW on
the masked-diffusion objective (dilaserve_jax.tasks.objective) over the suite's short tasks, with
params and optimiser state sharded FSDP-style over devices 0-3 and each batch split over them.
Serving: a dilaserve_jax.Server on devices 4-7 (two TP-2 instances; four TP-1 instances on a CPU,
whose XLA backend runs the collectives of all fake devices one program at a time, so a TP
instance's steps would wait for the training steps' all-gathers). Every --push-every
optimiser steps the loop hands its params to `server.update_weights` and goes on (the push copies
them device to device and swaps them in on the server's threads). A client thread sends held-out
prompts over gRPC and prints the accuracy it sees, with the weights the server said it was serving.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial

SHORT_TASKS = ("sort", "repeat")
TAU = 0.9


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Train the tiny model on devices 0-3 while a dilaserve_jax.Server serves "
                                            "it on devices 4-7; push weights every N steps; a gRPC client prints "
                                            "the held-out accuracy it sees.")
    p.add_argument("--steps", type=int, default=60, help="optimiser steps (default 60)")
    p.add_argument("--push-every", type=int, default=5, help="push weights every N steps (default 5)")
    p.add_argument("--batch-tokens", type=int, default=2048, help="tokens per training batch (default 2048)")
    p.add_argument("--lr", type=float, default=5e-4, help="AdamW learning rate (default 5e-4)")
    p.add_argument("--noise", type=float, default=1.0,
                   help="weakening: noise added to each weight matrix, in units of its own std (default 1.0)")
    p.add_argument("--prompts", type=int, default=24, help="held-out prompts per task per round (default 24)")
    p.add_argument("--mesh", default=None,
                   help="serving layout on devices 4-7 (default 2x2; 4x1 on CPU, where XLA runs the collectives "
                        "of all fake devices one program at a time, so a TP instance would wait for training steps)")
    p.add_argument("--slots", type=int, default=2, help="decode slots per instance (default 2)")
    p.add_argument("--cache", default="dual", choices=("dual", "prefix", "none"), help="KV cache mode (default dual)")
    p.add_argument("--port", type=int, default=0, help="gRPC port (default 0: any free port)")
    p.add_argument("--compile-cache", default=os.path.join(os.path.expanduser("~"), ".cache", "dilaserve_jax", "xla"),
                   help="persistent XLA compilation cache, so a second run skips compiling ('none' disables)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the summary as JSON at the end")
    return p


@dataclass(frozen=True, slots=True)
class Round:
    weights: str  # what GetClusterState said was served (before -> after, if it changed meanwhile)
    correct: int
    total: int
    errors: int
    seconds: float

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0


class AccuracyClient:
    """Sends held-out prompts over gRPC, grades the answers, reports per round."""

    def __init__(self, target: str, problems, say):
        from dilaserve_jax.frontend.client import DiLaServeClient

        self.client, self.problems, self.say = DiLaServeClient(target), problems, say
        self.rounds: list[Round] = []
        self._pool = ThreadPoolExecutor(8, thread_name_prefix="probe")

    def one_round(self) -> Round:
        import grpc

        from dilaserve_jax.tasks.graders import grade

        before = self.client.cluster_state().model
        t0 = time.perf_counter()

        def ask(problem):
            try:
                reply = self.client.generate(problem.prompt, max_new_tokens=12, block_length=12, slo_ms=60_000,
                                             tau_min=TAU, tau_max=TAU)
                return grade(problem, reply.text)
            except grpc.RpcError as err:
                self.say(f"[client] call failed: {err.code().name}: {err.details()}")
                return None

        outcomes = list(self._pool.map(ask, self.problems))
        after = self.client.cluster_state().model
        weights = before if before == after else f"{before} -> {after}"
        r = Round(weights, sum(o is True for o in outcomes), len(outcomes), sum(o is None for o in outcomes),
                  time.perf_counter() - t0)
        self.rounds.append(r)
        self.say(f"[client] weights {r.weights}: {r.correct}/{r.total} correct = {100 * r.accuracy:.0f}% "
                 f"({r.seconds:.1f} s)")
        return r

    def loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.one_round()

    def close(self) -> None:
        self._pool.shutdown()
        self.client.close()


def weakened(params, noise: float, seed: int):
    import jax
    import jax.numpy as jnp

    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [x + noise * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype) if x.ndim > 1
                                     else x for x, k in zip(leaves, keys)])


def run(args, say=print) -> dict:
    os.environ.setdefault("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from dilaserve_jax import Server
    from dilaserve_jax.models import load_model
    from dilaserve_jax.models.registry import ASSETS
    from dilaserve_jax.tasks.data import batches
    from dilaserve_jax.tasks.objective import diffusion_loss
    from dilaserve_jax.tasks.suite import unique_problems

    if len(jax.devices()) < 8:
        raise SystemExit(f"needs 8 devices (4 to train, 4 to serve); this process sees {len(jax.devices())}")
    train_devices, serve_devices = jax.devices()[:4], jax.devices()[4:8]
    mesh_spec = args.mesh or ("4x1" if jax.default_backend() == "cpu" else "2x2")
    tiny = load_model("tiny")
    cfg = tiny.config.replace(param_dtype="float32")  # train (and serve) in float32
    mesh = Mesh(np.array(train_devices), ("fsdp",))

    def fsdp(x):  # split the first axis over the 4 training devices when it divides
        return NamedSharding(mesh, P("fsdp") if x.ndim and x.shape[0] % 4 == 0 else P())

    params = weakened(jax.tree.map(lambda x: x.astype(jnp.float32), tiny.params), args.noise, args.seed)
    params = jax.device_put(params, jax.tree.map(fsdp, params))
    say(f"[main] tiny model weakened (noise {args.noise} std per matrix); training on devices "
        f"{[d.id for d in train_devices]}, serving on {[d.id for d in serve_devices]} as {mesh_spec}")

    server = Server(tiny.graphdef, params, devices=serve_devices, mesh=mesh_spec, port=args.port,
                    slots=args.slots, cache_mode=args.cache, length_buckets=(64,), block_buckets=(16,),
                    default_block_length=16, default_max_new_tokens=12, prior=str(ASSETS / "tiny" / "eval.json"),
                    name="weakened", controller="manual",  # a fixed layout: the CPU goes to training
                    compile_cache=None if args.compile_cache == "none" else args.compile_cache,
                    say=lambda m: say(f"[server] {m}"))

    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(args.lr, b1=0.9, b2=0.98, weight_decay=0.01))
    opt_state = jax.tree.map(lambda x: jax.device_put(x, fsdp(x)), optimizer.init(params))
    loss_fn = partial(diffusion_loss, graphdef=tiny.graphdef, mask_id=cfg.mask_id, eps=1e-3)
    shardings = lambda tree: jax.tree.map(lambda x: x.sharding, tree)  # noqa: E731

    @partial(jax.jit, donate_argnums=(0, 1), out_shardings=(shardings(params), shardings(opt_state), None))
    def train_step(params, opt_state, key, tokens, answer_mask, valid_len):
        loss, grads = jax.value_and_grad(loss_fn)(params, key=key, tokens=tokens, answer_mask=answer_mask,
                                                  valid_len=valid_len)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    data = batches(args.seed, args.batch_tokens, {"sort": 1.6, "repeat": 0.5})
    rows = NamedSharding(mesh, P("fsdp"))

    def next_batch():
        b = next(data)
        n = b.tokens.shape[0] // 4 * 4  # rows split evenly over the training devices
        return [jax.device_put(a[:n], rows) for a in (b.tokens, b.answer_mask, b.valid_len)]

    problems = [p for t in SHORT_TASKS for p in unique_problems(t, "heldout", args.prompts, seed=args.seed + 5)]
    say("[main] waiting for the server to compile; the baseline round runs first so the starting point is on record")
    server.wait_ready(1800)
    client = AccuracyClient(server.target, problems, say)
    baseline = client.one_round()
    stop = threading.Event()
    probe = threading.Thread(target=client.loop, args=(stop,), name="accuracy-client", daemon=True)
    probe.start()

    t0, pushes, caller_seconds = time.perf_counter(), [], []
    for step in range(1, args.steps + 1):
        params, opt_state, loss = train_step(params, opt_state, jax.random.key(step), *next_batch())
        if step % args.push_every == 0 or step == args.steps:
            t = time.perf_counter()
            future = server.update_weights(params, label=f"step {step}")  # returns at once
            caller_seconds.append(time.perf_counter() - t)
            future.add_done_callback(lambda f, s=step: say(
                f"[push] step {s} swapped in: {1e3 * f.result().dispatch_seconds:.0f} ms on the training thread, "
                f"{1e3 * f.result().copy_seconds:.0f} ms until copied (after the steps queued before it ran), "
                f"{1e3 * f.result().swap_seconds:.0f} ms swapping")
                if f.exception() is None else say(f"[push] step {s} failed: {f.exception()}"))
            pushes.append(future)
            say(f"[train] step {step}: loss {float(loss):.3f} ({time.perf_counter() - t0:.0f} s); pushed")
    reports = [f.result(600) for f in pushes]
    stop.set()
    probe.join()
    final = client.one_round()
    client.close()
    finished = server.stop()
    summary = {"baseline_accuracy": baseline.accuracy, "final_accuracy": final.accuracy,
               "rounds": [asdict(r) for r in client.rounds], "pushes": len(reports),
               "failed_calls": sum(r.errors for r in client.rounds), "train_seconds": time.perf_counter() - t0,
               "push_caller_ms_max": 1e3 * max(caller_seconds), "drained": finished}
    say(f"[main] accuracy {100 * baseline.accuracy:.0f}% -> {100 * final.accuracy:.0f}% over {args.steps} steps, "
        f"{len(reports)} pushes, {summary['failed_calls']} failed calls; the training thread spent at most "
        f"{summary['push_caller_ms_max']:.0f} ms per push")
    return summary


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.steps, args.push_every, args.batch_tokens, args.prompts, args.slots) < 1:
        print("error: steps, push-every, batch-tokens, prompts and slots must be positive", file=sys.stderr)
        return 2
    summary = run(args, say=lambda m: print(m, flush=True))
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
