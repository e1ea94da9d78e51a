"""Multi-process JAX (one process per host) for the serve command: flags and initialisation.

After `jax.distributed.initialize`, `jax.devices()` lists every process's devices, so a Layout
built over it spans hosts while each TP group stays inside one process (see layout.py). Call
`init_distributed` before anything else touches JAX devices.
"""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

_ADDRESS = re.compile(r"^[^\s:]+:\d{1,5}$")


@dataclass(frozen=True, slots=True)
class DistributedConfig:
    coordinator: str  # host:port of process 0's coordination service
    num_processes: int
    process_id: int
    timeout_s: int = 300  # how long to wait for every process to join

    def __post_init__(self):
        if not _ADDRESS.match(self.coordinator):
            raise ValueError(f"--coordinator must be host:port, got {self.coordinator!r}")
        if self.num_processes < 1:
            raise ValueError(f"--num-processes must be >= 1, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"--process-id must be in [0, {self.num_processes}), got {self.process_id}")
        if self.timeout_s <= 0:
            raise ValueError(f"--distributed-timeout must be positive, got {self.timeout_s}")


def add_distributed_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("multi-host", "run one process per host; all three flags or none")
    group.add_argument("--coordinator", metavar="HOST:PORT", default=None,
                       help="address of process 0's coordination service (e.g. 10.0.0.1:8476)")
    group.add_argument("--num-processes", type=int, default=None, metavar="N", help="total number of processes")
    group.add_argument("--process-id", type=int, default=None, metavar="I", help="this process's rank, 0..N-1")
    group.add_argument("--distributed-timeout", type=int, default=300, metavar="S",
                       help="seconds to wait for all processes to join (default 300)")
    return parser


def distributed_config(args: argparse.Namespace) -> DistributedConfig | None:
    """The validated flags, or None for a single-process run (no flag given)."""
    values = {"--coordinator": args.coordinator, "--num-processes": args.num_processes, "--process-id": args.process_id}
    given = [flag for flag, value in values.items() if value is not None]
    if not given:
        return None
    if len(given) != len(values):
        missing = [flag for flag in values if flag not in given]
        raise ValueError(f"multi-host runs need --coordinator, --num-processes and --process-id; missing {', '.join(missing)}")
    return DistributedConfig(args.coordinator, args.num_processes, args.process_id, args.distributed_timeout)


def init_distributed(args: argparse.Namespace) -> DistributedConfig | None:
    """Initialise JAX's multi-process runtime from the flags (no-op without them). Returns the config."""
    config = distributed_config(args)
    if config is None or config.num_processes == 1:
        return config
    import jax

    jax.distributed.initialize(coordinator_address=config.coordinator, num_processes=config.num_processes,
                               process_id=config.process_id, initialization_timeout=config.timeout_s)
    return config
