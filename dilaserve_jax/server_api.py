"""`dilaserve_jax.Server`: the whole server inside another JAX program, on a share of its devices.

    server = Server(model, devices=jax.devices()[4:], mesh="2x2", port=50051)   # returns at once
    ...                                                  # training loop on jax.devices()[:4]
    server.update_weights(params)                        # a Future; the loop goes on
    server.stop()                                        # drains in-flight calls

It runs the same pieces as `python -m dilaserve_jax.serve` -- gRPC service with health and
reflection, optional Prometheus metrics and OpenAI-compatible HTTP API (`http_port=`), the
scheduler and one engine thread per instance, the watchdog, optionally a checkpoint watcher -- on
background threads: gRPC (and HTTP) on its own asyncio event-loop thread, compilation and the
start-up latency profile on the engines' threads (a warm-up thread waits for them), pushed weights
on a push thread. The caller's thread only builds
the cluster at construction and, per push, enqueues device-to-device copies (serving/executor/push.py).

Memory on each serving device (docs/colocation.md): its shard of the weights, one more shard
while a push is in flight (old and new weights coexist until the swap), and the decode slots
(K/V cache + canvas), sized by `slots` or a per-device `kv_memory_gb` budget.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PushReport:
    """One `update_weights`: seconds on the caller's thread (checks + enqueueing copies); then until
    every copy landed (which includes waiting for the computation still producing the params, e.g.
    optimiser steps queued before the push); and for the swap itself; when each instance swapped
    (engine clock)."""

    label: str
    dispatch_seconds: float
    copy_seconds: float
    swap_seconds: float
    swapped_at: dict


class Server:
    def __init__(self, model, params=None, *, devices: Sequence | None = None, mesh: str = "1",
                 host: str = "127.0.0.1", port: int = 50051, metrics_port: int | None = None,
                 http_port: int | None = None, tokenizer=None,
                 name: str = "memory", watch_checkpoints: str | None = None, watch_interval_s: float = 10.0,
                 auth_token: str | None = None, admin_token: str | None = None, weights_roots: Sequence[str] = (),
                 grace_s: float = 30.0, compile_cache: str | None = None, say: Callable[[str], None] | None = None,
                 **serve_config: Any):
        """`model`: an nnx.Module, a (graphdef, params) pair, or a graphdef with `params`. `params` may
        live anywhere (e.g. sharded for training on other devices); they are copied device to device.
        `devices`: the jax devices to serve on (default all visible); `mesh`: their layout ("2x2",
        "4", ...). `http_port`: serve the OpenAI-compatible HTTP API there too (0: any free port;
        None: not). Other keywords go to ServeConfig (slots, kv_memory_gb, cache_mode, policy,
        profile, prior, tau_min, controller, ...). `compile_cache`: a directory for XLA's persistent
        compilation cache (a process-wide JAX setting; off by default); measured latency profiles
        are then kept beside it unless `profile_cache` says otherwise. Returns once gRPC listens
        (health NOT_SERVING while compiling)."""
        from dilaserve_jax.frontend.http.options import HttpOptions
        from dilaserve_jax.frontend.server import ServerOptions
        from dilaserve_jax.mesh.share import share_layout
        from dilaserve_jax.mesh.spec import check_model
        from dilaserve_jax.serving.executor.build import ServeConfig, build_cluster
        from dilaserve_jax.serving.executor.push import WeightPusher

        if jax.process_count() > 1:
            raise ValueError("Server runs in a single process; for multi-host serving use "
                             "`python -m dilaserve_jax.serve`")
        self._say = say or log.info
        if compile_cache is not None:
            from dilaserve_jax.decoding.compiled import enable_compile_cache
            from dilaserve_jax.serving.executor.profile_cache import profile_cache_dir

            enable_compile_cache(compile_cache)
            serve_config.setdefault("profile_cache", profile_cache_dir(None, compile_cache))
        model_cfg, params = _split(model, params)
        ids = None if devices is None else tuple(d.id for d in devices)
        self.config = ServeConfig(model=f"{name}:initial", mesh=mesh, devices=ids, **serve_config)
        self.options = ServerOptions(host=host, port=port, metrics_port=metrics_port, auth_token=auth_token,
                                     admin_token=admin_token, weights_roots=tuple(weights_roots), grace_s=grace_s)
        self.http_options = HttpOptions(http_port=http_port)
        layout = share_layout(mesh, ids)
        check_model(layout.spec, model_cfg)
        serving, plans = _serving_model(self.config, layout, model_cfg, params, tokenizer, f"{name}:initial")
        self.cluster = build_cluster(self.config, self._say, layout=layout, model=serving)
        self._pusher = WeightPusher(self.cluster, plans)
        self._name, self._push_numbers = name, itertools.count(1)
        self._push_thread = ThreadPoolExecutor(1, thread_name_prefix="dilaserve-push")
        self._ready, self._warm_error = threading.Event(), None
        self._stopped = False
        self.watcher = None
        if watch_checkpoints is not None:
            from dilaserve_jax.serving.executor.checkpoint_watch import CheckpointWatcher

            self.watcher = CheckpointWatcher(self.cluster, watch_checkpoints, interval_s=watch_interval_s,
                                             say=self._say)
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="dilaserve-grpc", daemon=True)
        self._loop_thread.start()
        try:
            self._running = self._on_loop(_start(self.cluster, self.options, self.http_options))
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            raise
        self.port = self._running.port
        self.metrics_port = self._running.metrics_port
        self.http_port = self._running.http_port
        self._say(f"listening on {host}:{self.port} (health NOT_SERVING while compiling)")
        self._warm_thread = threading.Thread(target=self._warm_up, name="dilaserve-warm-up", daemon=True)
        self._warm_thread.start()

    # --- lifecycle ---
    @property
    def layout(self):
        """The layout being served (a reconfiguration may change it, within the same devices)."""
        return self.cluster.builder.layout

    @property
    def target(self) -> str:
        return f"{self.options.host}:{self.port}"

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._warm_error is None

    def wait_ready(self, timeout: float | None = None) -> "Server":
        """Block until every instance is compiled and health says SERVING (raises what warm-up raised)."""
        if not self._ready.wait(timeout):
            raise TimeoutError(f"server not ready after {timeout} s (still compiling)")
        if self._warm_error is not None:
            raise RuntimeError(f"warm-up failed: {self._warm_error}") from self._warm_error
        return self

    def _warm_up(self) -> None:
        try:
            t0 = time.perf_counter()
            self.cluster.start()
            self.cluster.warm_up()
            self._on_loop(self._running.set_serving(True))
            if self.watcher is not None:
                self.watcher.start()
            self._say(f"ready: serving on {self.target} ({self.cluster.layout}) after {time.perf_counter() - t0:.1f} s")
        except BaseException as err:  # noqa: BLE001 - reported through wait_ready
            self._warm_error = err
            log.exception("warm-up failed")
        finally:
            self._ready.set()

    def stop(self, grace_s: float | None = None) -> bool:
        """Health NOT_SERVING, refuse new calls, let in-flight ones finish (up to the grace period), then
        stop the watcher, pending pushes, the engines and the event loop (a warm-up still compiling is
        waited for: a compilation cannot be interrupted). True if every call finished."""
        if self._stopped:
            return True
        self._stopped = True
        if self.watcher is not None:
            self.watcher.stop()
        finished = self._on_loop(self._running.drain_and_stop(grace_s), timeout=None)
        self._push_thread.shutdown(wait=True)
        self._warm_thread.join()
        self.cluster.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(10)
        return finished

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- weights ---
    def update_weights(self, params, label: str | None = None) -> Future:
        """Serve `params` (same model; any sharding, any devices of this process) from the next step on.

        On the calling thread: checks, casts to the served dtype and enqueues device-to-device copies
        into the serving layout -- after this returns the caller may donate or overwrite `params`.
        The copies to the other instances, the wait for them and the swap run on the push thread;
        the Future resolves to a PushReport when every instance serves the new weights (in order:
        pushes swap in the order made). Requests in flight continue on the new weights after a refresh
        step; shardings and dtypes equal the served ones, so nothing recompiles."""
        if self._stopped:
            raise RuntimeError("the server is stopped")
        t0 = time.perf_counter()
        dispatched = self._pusher.dispatch(params, label or f"{self._name}:push {next(self._push_numbers)}")
        dispatch_s = time.perf_counter() - t0
        return self._push_thread.submit(self._complete, dispatched, dispatch_s)

    def _complete(self, dispatched, dispatch_s: float) -> PushReport:
        t0 = time.perf_counter()
        report = self._pusher.complete(dispatched)
        total = time.perf_counter() - t0
        log.info("pushed weights %s swapped in (%.0f ms on the caller's thread, %.0f ms until copied, %.0f ms swap)",
                 dispatched.label, 1e3 * dispatch_s, 1e3 * (total - report.seconds), 1e3 * report.seconds)
        return PushReport(dispatched.label, dispatch_s, total - report.seconds, report.seconds,
                          dict(report.swapped_at))

    # --- observing ---
    def state(self) -> dict:
        """What GetClusterState reports (layout, instances, reloads, checkpoint watch, ...), as plain
        dicts and lists (JSON-ready); `server.cluster.state()` is the typed `ClusterState`."""
        return self.cluster.state().as_dict()

    def client(self, **kw):
        from dilaserve_jax.frontend.client import DiLaServeClient

        return DiLaServeClient(self.target, **kw)

    def _on_loop(self, coro, timeout: float | None = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)


async def _start(cluster, options, http=None):
    from dilaserve_jax.frontend.server import start_server

    return await start_server(cluster, options, http)


def _split(model, params):
    """(ModelConfig, params) from an nnx.Module, a (graphdef, params) pair, or a graphdef + params."""
    from flax import nnx

    if isinstance(model, nnx.Module):
        if params is not None:
            raise ValueError("pass either an nnx.Module or a graphdef with params, not both")
        return model.cfg, nnx.split(model)[1]
    if isinstance(model, tuple) and len(model) == 2 and params is None:
        model, params = model
    if params is None:
        raise ValueError("a graphdef needs its params: Server(graphdef, params, ...) or "
                         "Server((graphdef, params), ...)")
    return nnx.merge(model, params).cfg, params


def _serving_model(cfg, layout, model_cfg, params, tokenizer, source: str):
    """The build's ServingModel from params in memory (cast if asked, copied device to device into
    every instance), and the transfer plans that did it: pushes from the same shardings reuse them."""
    from dilaserve_jax.models.hf import abstract_params
    from dilaserve_jax.models.tokenizer import CharTokenizer
    from dilaserve_jax.serving.executor.build import ServingModel
    from dilaserve_jax.serving.cluster.weights_swap import IncompatibleWeights
    from dilaserve_jax.serving.executor.push import PlanCache

    held = {str(x.dtype) for x in jax.tree.leaves(params)}
    dtype = cfg.param_dtype or (held.pop() if len(held) == 1 and held <= {"float32", "bfloat16"} else None)
    model_cfg = model_cfg.replace(attention=cfg.attention, **({"param_dtype": dtype} if dtype else {}))
    graphdef, abstract = abstract_params(model_cfg)
    if jax.tree.structure(params) != jax.tree.structure(abstract):
        raise IncompatibleWeights(f"params do not match a {model_cfg.name} model's tree structure")
    if tokenizer is None:
        if model_cfg.vocab_size != CharTokenizer.vocab_size:
            raise ValueError(f"pass tokenizer= for a {model_cfg.vocab_size}-token vocabulary")
        tokenizer = CharTokenizer()
    plans = PlanCache(model_cfg)
    first = plans.place(params, layout.instances[0], [a.dtype for a in jax.tree.leaves(abstract)]
                        if cfg.param_dtype else None)
    per_instance = [first] + [plans.place(first, inst) for inst in layout.instances[1:]]
    return ServingModel(model_cfg, graphdef, tokenizer, source, per_instance), plans
