"""`python -m dilaserve_jax.serve --mesh 2x4`: the gRPC server (and the OpenAI-compatible HTTP API
beside it) over a mesh of model instances."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
from dataclasses import dataclass

from dilaserve_jax.core.cli import (add_config_arguments, config_from_args, opt, returns_exit_status,
                                    setup_logging)
from dilaserve_jax.mesh.distributed import add_distributed_args, distributed_config, init_distributed

log = logging.getLogger(__name__)
DEFAULT_COMPILE_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "dilaserve_jax", "xla")
SHARE = "sharing the machine (e.g. with a training job)"
CONTROLLER_FLAGS = ("interval_s", "min_dwell_s", "bandwidth_gbps", "feedback_min_requests", "price_bursts",
                    "latency_rate_margin", "latency_feedback_requests",
                    "switch_attainment_tolerance", "late_wait_rounds")


@dataclass(frozen=True, slots=True)
class ServeCommand:
    """What the serve process does besides serving: its compile cache and the checkpoint watch."""

    compile_cache: str = opt(DEFAULT_COMPILE_CACHE, "persistent XLA compilation cache directory, so restarts skip "
                                                    "recompiling ('none' disables)")
    watch_checkpoints: str | None = opt(None, "poll this orbax training directory (python -m dilaserve_jax.tasks.train "
                                              "--out DIR) and swap in each new finalized step; unreadable steps are "
                                              "skipped, the old weights stay", metavar="DIR")
    watch_interval_s: float = opt(10.0, "seconds between polls of --watch-checkpoints")
    ray_address: str | None = opt(None, "serve across the hosts of a Ray cluster: 'auto' (the one `ray start` "
                                        "joined this machine to), HOST:PORT of its head, or 'local' (start one "
                                        "here); one worker per node runs that host's instances with --mesh as "
                                        "each host's layout, this process serves them all (docs/multihost.md)",
                                  metavar="auto|HOST:PORT|local")

    def __post_init__(self):
        if not self.watch_interval_s > 0:
            raise ValueError(f"--watch-interval-s must be positive, got {self.watch_interval_s}")
        if self.ray_address is not None and not self.ray_address.strip():
            raise ValueError("--ray-address needs auto, HOST:PORT or local")


def build_parser() -> argparse.ArgumentParser:
    from dilaserve_jax.frontend.http.options import HttpOptions
    from dilaserve_jax.frontend.server import ServerOptions
    from dilaserve_jax.serving.executor.build import ServeConfig
    from dilaserve_jax.serving.policy.controller import ControllerConfig

    p = argparse.ArgumentParser(
        prog="python -m dilaserve_jax.serve",
        description="Serve a diffusion LM over gRPC and an OpenAI-compatible HTTP API on a mesh of model "
                    "instances, scheduling denoising steps deadline-first and adapting each request's confidence "
                    "threshold. Defaults work on a fresh machine: the embedded tiny model, loopback, CPU devices "
                    "when there is no accelerator.")
    add_config_arguments(p, ServeConfig, exclude=("length_buckets", "block_buckets", "param_dtype",
                                                  "default_block_length", "allow_unused_devices", "controller_config",
                                                  "devices", "kv_memory_gb"))
    add_config_arguments(p, ControllerConfig, only=CONTROLLER_FLAGS)
    add_config_arguments(p, ServerOptions, exclude=("max_message_bytes",))
    add_config_arguments(p, HttpOptions)
    add_config_arguments(p, ServeCommand, only=("compile_cache",))
    add_config_arguments(p, ServeConfig, only=("devices", "kv_memory_gb"), group=SHARE)
    add_config_arguments(p, ServeCommand, only=("watch_checkpoints", "watch_interval_s"), group=SHARE)
    add_distributed_args(p)
    add_config_arguments(p, ServeCommand, only=("ray_address",), group="multi-host")
    return p


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


@returns_exit_status
def main(argv: list[str] | None = None) -> int:
    from dilaserve_jax.frontend.http.options import HttpOptions
    from dilaserve_jax.frontend.server import ServerOptions
    from dilaserve_jax.serving.executor.build import ServeConfig
    from dilaserve_jax.serving.policy.controller import ControllerConfig

    parser = build_parser()
    args = parser.parse_args(argv)
    # the server's own log (requests, reloads, controller rounds) with time, level and source
    setup_logging(log, verbose=True, detailed=True)
    # JAX probes every backend at start-up; on a machine without a TPU that probe's INFO line is noise
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    command = config_from_args(ServeCommand, args, parser)
    config = config_from_args(ServeConfig, args, parser,
                              controller_config=config_from_args(ControllerConfig, args, parser))
    options = config_from_args(ServerOptions, args, parser)
    http = config_from_args(HttpOptions, args, parser)
    if command.ray_address is not None:
        return _serve_ray_hosts(command, config, options, http, args)
    try:
        dist = distributed_config(args)
        cpu_devices = present_cpu_devices(config.mesh, dist.num_processes if dist else 1, config.devices)
        init_distributed(args)
        import jax

        from dilaserve_jax.decoding.compiled import enable_compile_cache
        from dilaserve_jax.serving.executor.build import build_cluster
        from dilaserve_jax.serving.executor.profile_cache import profile_cache_dir

        enable_compile_cache(command.compile_cache)
        config = dataclasses.replace(config, profile_cache=profile_cache_dir(config.profile_cache,
                                                                             command.compile_cache))
        if jax.default_backend() == "cpu":
            log.info(f"no accelerator found: presenting {cpu_devices} CPU devices for mesh {config.mesh}")
        cluster = build_cluster(config, log.info)
    except (ValueError, FileNotFoundError) as err:
        log.error(f"error: {err}")
        return 2
    watcher = None
    if command.watch_checkpoints:
        from dilaserve_jax.serving.executor.checkpoint_watch import CheckpointWatcher, served_step

        directory = command.watch_checkpoints
        watcher = CheckpointWatcher(cluster, directory, interval_s=command.watch_interval_s, say=log.info,
                                    after_step=served_step(cluster.model_source, directory))
    return asyncio.run(_serve(cluster, options, watcher, http))


def _serve_ray_hosts(command: ServeCommand, config, options, http, args) -> int:
    """The leader of a multi-host server: no JAX here; each node's worker builds its host's instances."""
    if distributed_config(args) is not None:
        log.error("error: --ray-address and --coordinator/--num-processes/--process-id are two ways to run on "
                  "several hosts; pick one")
        return 2
    if command.watch_checkpoints:
        log.error("error: --watch-checkpoints is not available with --ray-address (the leader reads no checkpoints; "
                  "ReloadWeights loads a step on every host)")
        return 2
    try:
        import ray
    except ImportError:
        log.error("error: --ray-address needs Ray: pip install 'dilaserve-jax[multihost]'")
        return 2
    from dilaserve_jax.mesh.spec import MeshSpec
    from dilaserve_jax.serving.cluster.hosts.ray_hosts import RayHosts
    from dilaserve_jax.serving.executor.hosts import ExecutorHostFactory
    from dilaserve_jax.serving.executor.profile_cache import profile_cache_dir

    try:
        devices = MeshSpec.parse(config.mesh).num_devices
    except ValueError as err:
        log.error(f"error: {err}")
        return 2
    config = dataclasses.replace(config, profile_cache=profile_cache_dir(config.profile_cache, command.compile_cache))
    if command.ray_address == "local":
        ray.init(include_dashboard=False)
    else:
        ray.init(address=command.ray_address)
    # only shapes the CPU platform: a host without an accelerator presents the devices the mesh needs
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    hosts = RayHosts(ExecutorHostFactory(config, command.compile_cache), env_vars={"XLA_FLAGS": flags},
                     watchdog_s=config.step_timeout_s, say=log.info)
    try:
        cluster = hosts.start(step_timeout_s=None)  # each host watches its own runner calls
        log.info(f"serving {len(cluster.infos)} instance(s) on {len(hosts.links)} host(s): {cluster.layout}")
        if config.controller != "manual":
            from dilaserve_jax.serving.cluster.hosts.hosts_control import start_hosts_controller

            ctl = start_hosts_controller(hosts, config.controller_config, config.controller, config.layouts)
            log.info(f"controller: {config.controller} across hosts, {len(ctl.candidates)} candidate layouts over "
                     f"TP {list(ctl.tp_degrees)} (each host's devices in its own TP groups); a layout reads one part "
                     f"per host, joined by '|'")
        return asyncio.run(_serve(cluster, options, None, http))
    finally:
        hosts.stop()
        ray.shutdown()


async def _serve(cluster, options, watcher=None, http=None) -> int:
    from dilaserve_jax.frontend.server import start_server

    try:
        running = await start_server(cluster, options, http)
    except OSError as err:  # a port in use, an address not on this machine
        log.error(f"error: cannot listen on {options.host}: {err}")
        cluster.stop(wait_background=False)
        return 2
    scheme = "grpcs" if options.tls_cert else "grpc"
    web = "https" if options.tls_cert else "http"
    log.info(f"listening on {scheme}://{options.host}:{running.port} (health NOT_SERVING while compiling)"
        + (f"; OpenAI-compatible API on {web}://{options.host}:{running.http_port}/v1 (/health 503 while "
           f"compiling)" if running.http_port else "")
        + (f"; metrics on http://{options.host}:{running.metrics_port}/metrics" if running.metrics_port else ""))
    log.info("auth: " + ("on (every call needs 'authorization: Bearer <token>')" if options.auth_token else "off")
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
        log.info(f"ready: serving {cluster.model_source} with policy {cluster.policy} on "
            f"{options.host}:{running.port} (try: python -m dilaserve_jax.client --target "
            f"{options.host}:{running.port}{token}{tls} \"sort 93142=\")")
        if running.http_port:
            bearer = " -H \"Authorization: Bearer $DILASERVE_AUTH_TOKEN\"" if options.auth_token else ""
            log.info(f"ready: OpenAI-compatible API (try: curl{' --cacert ' + options.tls_cert if options.tls_cert else ''}"
                     f" {web}://{options.host}:{running.http_port}/v1/completions{bearer} -d "
                     f"'{{\"prompt\": \"sort 93142=\", \"max_tokens\": 12}}')")
        if watcher is not None:
            watcher.start()
            log.info(f"watching {watcher.directory} for new training steps every {watcher.interval_s:g} s")
        await stop.wait()
    if watcher is not None:
        watcher.stop()
    log.info(f"draining: letting in-flight calls finish (up to {options.grace_s:.0f} s)")
    finished = await running.drain_and_stop()
    cluster.stop(wait_background=False)
    log.info("stopped" if finished else "stopped with calls still in flight after the grace period")
    switching = cluster.autoscaler is not None and cluster.autoscaler.alive
    if not warm.done() or switching or any(t.is_alive() for t in cluster.background):
        # start-up compilation or measurement, or a layout switch's compilation, still running:
        # leave without waiting for it, and without finalising the interpreter under a running
        # XLA thread (that aborts the process)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
