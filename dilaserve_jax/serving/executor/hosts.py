"""The host factory of `serve --ray-address`: inside a host's worker process, build that host's
instances with JAX exactly as a one-process `serve` builds them (load, lay out over the host's
own devices, compile, warm, measure latency), and hand their engines to the worker.

The worker process is a fresh Python process on its host, so JAX initialises there, over that
host's devices only: no `jax.distributed` (each TP group lives on one host, and instances on
different hosts never run a collective together). No controller runs on the hosts: the leader's
is the one over every instance. With one there (`--controller auto` or `paused`), each host gives
every TP degree its devices can hold a latency model before it serves, as one-process serve does,
and sends them to the leader with what else the controller needs (`control_inputs`).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from dilaserve_jax.serving.cluster.hosts.worker import HostBuild
from dilaserve_jax.serving.cluster.weights_swap import NewWeights
from dilaserve_jax.serving.executor.build import ServeConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ExecutorHostFactory:
    config: ServeConfig  # `mesh` is the layout of each host's devices; `controller` the leader's mode
    compile_cache: str | None = None  # persistent XLA compilation cache directory on each host

    def build(self, host: str) -> HostBuild:
        from dilaserve_jax.decoding.compiled import enable_compile_cache
        from dilaserve_jax.serving.executor.build import build_cluster, control_inputs

        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {host} %(levelname)s %(message)s")
        enable_compile_cache(self.compile_cache)
        local = build_cluster(self.config, log.info, run_controller=False)
        return HostBuild(local.engines, [dataclasses.replace(i, host=host) for i in local.infos], local.tokenizer,
                         local.limits, local.policy, local.model_source, local.family, warm_up=local.warm_up,
                         builder=local.builder, control=lambda: control_inputs(local.builder),
                         weights=BuilderWeights(local.builder))


class BuilderWeights:
    """A host's reloads through its instance builder (the one-process reload's loader), with the
    weights from before the last load kept until they are swapped in everywhere on this host, to
    put back when another host fails."""

    def __init__(self, builder) -> None:
        self.builder = builder
        self._before = None

    def load(self, source: str, step: int | None) -> NewWeights:
        b = self.builder
        self._before = (dict(b.params), b.model.source, b.layout)
        return b.load(source, step)

    def undo(self) -> None:
        if self._before is not None:
            params, source, layout = self._before
            self._before = None
            self.builder.adopt(params, source, layout)

    def settle(self) -> None:
        self._before = None  # every instance has the new weights: the old ones may go
