"""Shape buckets: every jitted step has a static shape picked from a small finite set.

A step's shape is (kind, batch bucket, canvas length bucket, block bucket, query bucket). Each
request gets its length and block bucket once, at admission, so the numerics of its rows never
depend on which other requests share its batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from dilaserve_jax.core.buckets import powers_of_two_up_to
from dilaserve_jax.core.kinds import CacheMode
from dilaserve_jax.decoding.shift import dual_queries


class StepType(str, Enum):
    """What one compiled executable computes (the runner maps REFRESH/REUSE + cache mode to it)."""

    FULL = "full"  # whole canvas, no cache (cache mode none)
    REFRESH = "refresh"  # whole canvas, writes K/V of every position into the cache
    DUAL = "dual"  # current block only, attends to the cache
    PREFIX = "prefix"  # current block + suffix, attends to the cache


def prefix_query_buckets(length: int, block: int) -> tuple[int, ...]:
    """Query counts a prefix-cache reuse step can take: block, 2*block, ... up to the canvas length."""
    return powers_of_two_up_to(length, start=min(block, length))


@dataclass(frozen=True, slots=True)
class StepShape:
    """The static shape of one compiled step; also the key of its executable."""

    step: StepType
    batch: int
    length: int  # canvas length bucket: positions [0, length) of the state's canvas
    block: int  # block bucket: commit window width
    queries: int  # query rows of the forward

    def __post_init__(self):
        if min(self.batch, self.length, self.block, self.queries) < 1:
            raise ValueError(f"all StepShape sizes must be positive: {self}")
        if self.block > self.length or self.queries > self.length:
            raise ValueError(f"block and queries must fit the canvas length: {self}")
        if self.step in (StepType.FULL, StepType.REFRESH) and self.queries != self.length:
            raise ValueError(f"full-canvas steps query every position: {self}")
        if self.step is StepType.DUAL and not self.block <= self.queries <= self.block + 1:
            raise ValueError(f"dual-cache reuse steps query the block only (plus the row before it for "
                             f"shifted-logits models): {self}")
        if self.step is StepType.PREFIX and self.queries < self.block:
            raise ValueError(f"prefix-cache reuse steps query at least the block: {self}")


def shapes_for(mode: CacheMode, batch_buckets: tuple[int, ...], length_buckets: tuple[int, ...],
               block_buckets: tuple[int, ...], shift: int = 0) -> list[StepShape]:
    """Every step shape a decoder in `mode` can run: what start-up compiles ahead of time.
    shift: the model's logits shift (dual reuse steps then query one row before the block)."""
    shapes = []
    for length in length_buckets:
        for block in (b for b in block_buckets if b <= length):
            for batch in batch_buckets:
                if mode is CacheMode.NONE:
                    shapes.append(StepShape(StepType.FULL, batch, length, block, length))
                    continue
                shapes.append(StepShape(StepType.REFRESH, batch, length, block, length))
                if mode is CacheMode.DUAL:
                    shapes.append(StepShape(StepType.DUAL, batch, length, block, dual_queries(block, length, shift)))
                else:
                    shapes.extend(StepShape(StepType.PREFIX, batch, length, block, q)
                                  for q in prefix_query_buckets(length, block))
    return shapes
