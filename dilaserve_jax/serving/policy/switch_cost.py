"""What a layout switch costs in time: building the instances the new layout adds (pure)."""
from __future__ import annotations

from typing import Sequence

from dilaserve_jax.core.layouts import placements
from dilaserve_jax.serving.policy.controller_config import ControllerConfig


def build_seconds(old: Sequence[int], new: Sequence[int], compiled: frozenset[tuple[int, int]],
                  cfg: ControllerConfig) -> float:
    """Seconds to build the instances of layout `new` that `old` lacks, one after another: each
    is built and warmed (`load_s`), and compiled first if its placement is not in `compiled`."""
    kept = placements(old)
    added = [p for p in placements(new) if p not in kept]
    return cfg.load_s * len(added) + cfg.compile_s * sum(p not in compiled for p in added)
