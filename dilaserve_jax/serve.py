"""`python -m dilaserve_jax.serve --mesh 2x4`: the gRPC server over a mesh of model instances."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from dilaserve_jax.mesh.distributed import add_distributed_args, distributed_config, init_distributed
from dilaserve_jax.serving.policy import limits as defaults

DEFAULT_PORT = 50051
DEFAULT_METRICS_PORT = 9464


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dilaserve_jax.serve",
        description="Serve a diffusion LM over gRPC on a mesh of model instances, scheduling denoising steps "
                    "deadline-first and adapting each request's confidence threshold. Defaults work on a "
                    "fresh machine: the embedded tiny model, loopback, CPU devices when there is no accelerator.")
    p.add_argument("--mesh", default="2x4", help='instances x TP degree, e.g. "2x4", "8", "8x1", "4+2+1+1" (default 2x4)')
    p.add_argument("--model", default="tiny", help="preset (tiny, test, test_dream), HF directory (LLaDA or Dream), or orbax training directory")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"gRPC port (default {DEFAULT_PORT}; 0 = any free port)")
    p.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT,
                   help=f"Prometheus metrics port (default {DEFAULT_METRICS_PORT}; -1 disables)")
    p.add_argument("--policy", default="dilaserve", choices=("dilaserve", "edf-static", "fcfs-static"),
                   help="scheduling policy (default dilaserve)")
    p.add_argument("--default-slo-ms", type=float, default=defaults.DEFAULT_SLO_MS,
                   help=f"deadline for calls with neither a gRPC deadline nor slo_ms (default {defaults.DEFAULT_SLO_MS:g})")
    p.add_argument("--default-max-new-tokens", type=int, default=defaults.DEFAULT_MAX_NEW_TOKENS,
                   help=f"answer length for calls that do not set max_new_tokens (default "
                        f"{defaults.DEFAULT_MAX_NEW_TOKENS}: the tiny model's answer area for its short tasks; raise "
                        "it for real checkpoints)")
    p.add_argument("--max-queue", type=int, default=defaults.DEFAULT_MAX_QUEUE,
                   help=f"waiting requests per instance before RESOURCE_EXHAUSTED (default {defaults.DEFAULT_MAX_QUEUE})")
    p.add_argument("--slots", type=int, default=defaults.DEFAULT_SLOTS,
                   help=f"concurrent requests (decode slots) per instance (default {defaults.DEFAULT_SLOTS})")
    p.add_argument("--cache", default="dual", choices=("dual", "prefix", "none"), help="KV cache mode (default dual)")
    p.add_argument("--attention", default="auto", choices=("auto", "xla", "pallas"),
                   help="attention implementation; auto = Pallas on GPU/TPU, XLA on CPU")
    p.add_argument("--tau-min", type=float, default=defaults.DEFAULT_TAU_MIN,
                   help=f"default quality floor (default {defaults.DEFAULT_TAU_MIN})")
    p.add_argument("--tau-max", type=float, default=defaults.DEFAULT_TAU_MAX,
                   help=f"default threshold ceiling (default {defaults.DEFAULT_TAU_MAX})")
    p.add_argument("--step-timeout-s", type=float, default=defaults.DEFAULT_STEP_TIMEOUT_S,
                   help="watchdog: an instance whose step runs longer than this is failed and its requests move to "
                        f"the others (default {defaults.DEFAULT_STEP_TIMEOUT_S:g}; 0 disables)")
    p.add_argument("--profile", help="step-latency profile JSON (from `python -m dilaserve_jax.bench.profile`); "
                                     "measured at start-up when omitted")
    p.add_argument("--prior", help="eval rows (`python -m dilaserve_jax.tasks.eval --json`) for the threshold "
                                   "controller's tokens-per-step and accuracy priors; default: eval*.json beside "
                                   "the weights")
    p.add_argument("--max-accuracy-drop", type=_points, default=1.0, metavar="PTS",
                   help="bound on the mean predicted accuracy drop, in points vs the accuracy at tau_max, over the "
                        "requests each instance serves ('inf' = unbounded; default 1.0); a request may set its own")
    p.add_argument("--budget-mode", default="adaptive", choices=("adaptive", "floor"),
                   help="adaptive: spend the budget per request on first-step evidence, where it buys deadlines; "
                        "floor: the lowest τ within budget for everyone (default adaptive)")
    p.add_argument("--controller", default="auto", choices=("auto", "paused", "manual"),
                   help="cluster controller: auto reshapes the layout and migrates requests as load changes; "
                        "paused starts it paused (Reconfigure allowed); manual runs none (default auto)")
    p.add_argument("--layouts", default="", metavar="SPEC[,SPEC...]",
                   help="layouts the controller may choose, e.g. '1x8,2x4,4x2,8x1' (default: every partition of "
                        "the devices into power-of-two TP groups the model allows)")
    p.add_argument("--controller-interval-s", type=float, default=2.0, help="seconds between decisions (default 2)")
    p.add_argument("--min-dwell-s", type=float, default=30.0,
                   help="minimum seconds between two layout switches (default 30)")
    p.add_argument("--interconnect-gbps", type=float, default=100.0,
                   help="device-to-device bandwidth the controller assumes for resharding (GB/s, default 100)")
    p.add_argument("--auth-token", default=os.environ.get("DILASERVE_AUTH_TOKEN"),
                   help="require 'authorization: Bearer TOKEN' on every call (or set DILASERVE_AUTH_TOKEN)")
    p.add_argument("--admin-token", default=os.environ.get("DILASERVE_ADMIN_TOKEN"),
                   help="token for the admin calls ReloadWeights and Reconfigure (or set DILASERVE_ADMIN_TOKEN); "
                        "without it they are allowed on a loopback address only")
    p.add_argument("--weights-root", action="append", default=[], metavar="DIR",
                   help="a directory ReloadWeights may read from, besides the served model's own (repeatable)")
    p.add_argument("--tls-cert", help="PEM certificate chain for TLS (with --tls-key)")
    p.add_argument("--tls-key", help="PEM private key for TLS (with --tls-cert)")
    p.add_argument("--compile-cache", default=os.path.join(os.path.expanduser("~"), ".cache", "dilaserve_jax", "xla"),
                   help="persistent XLA compilation cache directory, so restarts skip recompiling ('none' disables)")
    p.add_argument("--grace-s", type=float, default=30.0, help="on SIGINT/SIGTERM, seconds to let calls finish (default 30)")
    share = p.add_argument_group("sharing the machine (e.g. with a training job)")
    share.add_argument("--devices", "--device-ids", dest="devices", metavar="IDS",
                       help='serve on these visible devices only: "4-7", "4,5,6,7" or "0-1,6-7" (default all); '
                            "the mesh must use exactly that many")
    share.add_argument("--kv-memory-gb", type=float, metavar="GIB",
                       help="per-device memory (GiB) for the decode slots' K/V cache and canvases: each instance "
                            "gets as many slots as fit, at most --slots (default: --slots, whatever they take)")
    share.add_argument("--watch-checkpoints", metavar="DIR",
                       help="poll this orbax training directory (python -m dilaserve_jax.tasks.train --out DIR) and "
                            "swap in each new finalized step; unreadable steps are skipped, the old weights stay")
    share.add_argument("--watch-interval-s", type=float, default=10.0,
                       help="seconds between polls of --watch-checkpoints (default 10)")
    add_distributed_args(p)
    return p


def _points(text: str) -> float | None:
    if text.lower() in ("inf", "none", "unbounded"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected points >= 0 or 'inf', got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected points >= 0 or 'inf', got {text!r}")
    return value


def present_cpu_devices(mesh: str, processes: int, device_ids: tuple[int, ...] | None = None) -> int:
    """Ask for as many host (CPU) devices as the mesh (or the highest id of a device share) needs,
    before JAX starts. Harmless with an accelerator: the flag only shapes the CPU platform."""
    from dilaserve_jax.mesh.spec import MeshSpec

    needed = max(MeshSpec.parse(mesh).num_devices, max(device_ids) + 1 if device_ids else 0)
    per_process = -(-needed // max(1, processes))
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={per_process}".strip()
    return per_process


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # JAX probes every backend at start-up; on a machine without a TPU that probe's INFO line is noise
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    try:
        from dilaserve_jax.mesh.share import parse_device_ids

        dist = distributed_config(args)
        device_ids = parse_device_ids(args.devices) if args.devices is not None else None
        if args.watch_interval_s <= 0:
            raise ValueError(f"--watch-interval-s must be positive, got {args.watch_interval_s}")
        cpu_devices = present_cpu_devices(args.mesh, dist.num_processes if dist else 1, device_ids)
        init_distributed(args)
        import jax

        from dilaserve_jax.frontend.server import ServerOptions
        from dilaserve_jax.serving.executor.build import ServeConfig, build_cluster
        from dilaserve_jax.serving.policy.controller import ControllerConfig

        from dilaserve_jax.decoding.compiled import enable_compile_cache

        enable_compile_cache(args.compile_cache)
        if jax.default_backend() == "cpu":
            say(f"no accelerator found: presenting {cpu_devices} CPU devices for mesh {args.mesh}")
        config = ServeConfig(model=args.model, mesh=args.mesh, policy=args.policy, slots=args.slots,
                             cache_mode=args.cache, attention=args.attention, max_queue=args.max_queue,
                             default_slo_ms=args.default_slo_ms, tau_min=args.tau_min, tau_max=args.tau_max,
                             profile=args.profile, prior=args.prior,
                             default_max_new_tokens=args.default_max_new_tokens,
                             step_timeout_s=args.step_timeout_s or None, devices=device_ids,
                             kv_memory_gb=args.kv_memory_gb, controller=args.controller,
                             layouts=tuple(x for x in args.layouts.split(",") if x.strip()),
                             controller_config=ControllerConfig(interval_s=args.controller_interval_s,
                                                                min_dwell_s=args.min_dwell_s,
                                                                bandwidth_gbps=args.interconnect_gbps),
                             max_accuracy_drop=args.max_accuracy_drop, budget_mode=args.budget_mode)
        options = ServerOptions(host=args.host, port=args.port,
                                metrics_port=None if args.metrics_port < 0 else args.metrics_port,
                                auth_token=args.auth_token, admin_token=args.admin_token,
                                weights_roots=tuple(args.weights_root), tls_cert=args.tls_cert, tls_key=args.tls_key,
                                grace_s=args.grace_s)
        cluster = build_cluster(config, say)
    except (ValueError, FileNotFoundError) as err:
        say(f"error: {err}")
        return 2
    watcher = None
    if args.watch_checkpoints:
        from dilaserve_jax.serving.executor.checkpoint_watch import CheckpointWatcher, served_step

        watcher = CheckpointWatcher(cluster, args.watch_checkpoints, interval_s=args.watch_interval_s, say=say,
                                    after_step=served_step(cluster.model_source, args.watch_checkpoints))
    return asyncio.run(_serve(cluster, options, say, watcher))


async def _serve(cluster, options, say, watcher=None) -> int:
    from dilaserve_jax.frontend.server import start_server

    running = await start_server(cluster, options)
    scheme = "grpcs" if options.tls_cert else "grpc"
    say(f"listening on {scheme}://{options.host}:{running.port} (health NOT_SERVING while compiling)"
        + (f"; metrics on http://{options.host}:{running.metrics_port}/metrics" if running.metrics_port else ""))
    say("auth: " + ("on (every call needs 'authorization: Bearer <token>')" if options.auth_token else "off")
        + "; admin calls (ReloadWeights, Reconfigure): "
        + ("need the admin token" if options.admin_token else "allowed on loopback" if running.access.admin_open
           else f"REFUSED: {options.host} is not loopback and no --admin-token is set")
        + "; reloads may read " + ", ".join(map(str, running.service.weights_roots)))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    cluster.start()
    warm = asyncio.ensure_future(asyncio.to_thread(cluster.warm_up))
    done, _ = await asyncio.wait({warm, asyncio.ensure_future(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
    if warm in done:
        warm.result()
        await running.set_serving(True)
        token = " --token $DILASERVE_AUTH_TOKEN" if options.auth_token else ""
        tls = f" --tls-ca {options.tls_cert}" if options.tls_cert else ""
        say(f"ready: serving {cluster.model_source} with policy {cluster.policy} on "
            f"{options.host}:{running.port} (try: python -m dilaserve_jax.client --target "
            f"{options.host}:{running.port}{token}{tls} \"sort 93142=\")")
        if watcher is not None:
            watcher.start()
            say(f"watching {watcher.directory} for new training steps every {watcher.interval_s:g} s")
        await stop.wait()
    if watcher is not None:
        watcher.stop()
    say(f"draining: letting in-flight calls finish (up to {options.grace_s:.0f} s)")
    finished = await running.drain_and_stop()
    cluster.stop(wait_background=False)
    say("stopped" if finished else "stopped with calls still in flight after the grace period")
    if not warm.done() or any(t.is_alive() for t in cluster.background):
        # compilation still running (start-up, or the controller's background measurement): leave
        # without waiting for it, and without finalising the interpreter under a running XLA thread
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
