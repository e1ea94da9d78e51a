"""The host factory of `serve --ray-address`: inside a host's worker process, build that host's
instances with JAX exactly as a one-process `serve` builds them (load, lay out over the host's
own devices, compile, warm, measure latency), and hand their engines to the worker.

The worker process is a fresh Python process on its host, so JAX initialises there, over that
host's devices only: no `jax.distributed` (each TP group lives on one host, and instances on
different hosts never run a collective together). The controller stays off on the hosts: the
leader's cluster is the one view of every instance.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from dilaserve_jax.serving.cluster.hosts.worker import HostBuild
from dilaserve_jax.serving.executor.build import ServeConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ExecutorHostFactory:
    config: ServeConfig  # `mesh` is the layout of each host's devices
    compile_cache: str | None = None  # persistent XLA compilation cache directory on each host

    def build(self, host: str) -> HostBuild:
        from dilaserve_jax.decoding.compiled import enable_compile_cache
        from dilaserve_jax.serving.executor.build import build_cluster

        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {host} %(levelname)s %(message)s")
        enable_compile_cache(self.compile_cache)
        local = build_cluster(dataclasses.replace(self.config, controller="manual"), log.info)
        return HostBuild(local.engines, [dataclasses.replace(i, host=host) for i in local.infos], local.tokenizer,
                         local.limits, local.policy, local.model_source, local.family, warm_up=local.warm_up,
                         builder=local.builder)
