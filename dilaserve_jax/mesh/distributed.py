"""Multi-process JAX (one process per host) for the serve command: flags and initialisation.

After `jax.distributed.initialize`, `jax.devices()` lists every process's devices, so a Layout
built over it spans hosts while each TP group stays inside one process (see layout.py). Call
`init_distributed` before anything else touches JAX devices.
"""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

from dilaserve_jax.core.cli import add_config_arguments, opt

_ADDRESS = re.compile(r"^[^\s:]+:\d{1,5}$")
_GROUP = "multi-host"


@dataclass(frozen=True, slots=True)
class DistributedConfig:
    """The multi-host flags: all three of coordinator, num_processes and process_id, or none of them
    (one process; `enabled` is False)."""

    coordinator: str | None = opt(None, "address of process 0's coordination service (e.g. 10.0.0.1:8476)",
                                  metavar="HOST:PORT")
    num_processes: int | None = opt(None, "total number of processes", metavar="N")
    process_id: int | None = opt(None, "this process's rank, 0..N-1", metavar="I")
    timeout_s: int = opt(300, "seconds to wait for all processes to join", name="--distributed-timeout", metavar="S")

    def __post_init__(self):
        flags = {"--coordinator": self.coordinator, "--num-processes": self.num_processes,
                 "--process-id": self.process_id}
        missing = [flag for flag, value in flags.items() if value is None]
        if len(missing) == len(flags):
            return
        if missing:
            raise ValueError(f"multi-host runs need --coordinator, --num-processes and --process-id; missing "
                             f"{', '.join(missing)}")
        if not _ADDRESS.match(self.coordinator):
            raise ValueError(f"--coordinator must be host:port, got {self.coordinator!r}")
        if self.num_processes < 1:
            raise ValueError(f"--num-processes must be >= 1, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"--process-id must be in [0, {self.num_processes}), got {self.process_id}")
        if self.timeout_s <= 0:
            raise ValueError(f"--distributed-timeout must be positive, got {self.timeout_s}")

    @property
    def enabled(self) -> bool:
        return self.coordinator is not None


def add_distributed_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument_group(_GROUP, "run one process per host; all three flags or none")
    return add_config_arguments(parser, DistributedConfig, group=_GROUP)


def distributed_config(args: argparse.Namespace) -> DistributedConfig | None:
    """The validated flags (ValueError says what is wrong), or None for a single-process run."""
    config = DistributedConfig(args.coordinator, args.num_processes, args.process_id, args.distributed_timeout)
    return config if config.enabled else None


def init_distributed(args: argparse.Namespace) -> DistributedConfig | None:
    """Initialise JAX's multi-process runtime from the flags (no-op without them). Returns the config."""
    config = distributed_config(args)
    if config is None or config.num_processes == 1:
        return config
    import jax

    jax.distributed.initialize(coordinator_address=config.coordinator, num_processes=config.num_processes,
                               process_id=config.process_id, initialization_timeout=config.timeout_s)
    return config
