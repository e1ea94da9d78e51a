"""The shape-bucket rule: which padded sizes a step runs at.

Every compiled step has a static shape; a request gets its canvas-length and block buckets once, at
admission, and a batch is padded to a batch bucket. The decoder, the simulator's step-time model
and the policies benchmark's profiled clock all bucket with these functions, so they agree on what
a step costs.
"""
from __future__ import annotations

import bisect
from typing import Sequence


def powers_of_two_up_to(limit: int, start: int = 1) -> tuple[int, ...]:
    """start, 2*start, 4*start, ... and finally `limit` itself (so the largest bucket fits exactly)."""
    if limit < 1 or start < 1:
        raise ValueError(f"limit and start must be positive, got {limit}, {start}")
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= 2
    out.append(limit)
    return tuple(out)


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n (buckets sorted ascending)."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1] if buckets else None}")
    return buckets[i]


def padded(n: int, buckets: Sequence[int]) -> int:
    """`bucket_for`, or `n` itself when there are no buckets or none is large enough (a model
    that prices shapes it was never told the buckets of)."""
    return bucket_for(n, buckets) if buckets and n <= buckets[-1] else n


def slot_buckets(prompt_length: int, answer_length: int, block_length: int, length_buckets: Sequence[int],
                 block_buckets: Sequence[int]) -> tuple[int, int]:
    """(canvas-length bucket, block bucket) a request is admitted with. A block never extends past
    the answer, so a short answer takes a smaller block bucket if one exists."""
    return (bucket_for(prompt_length + answer_length, length_buckets),
            bucket_for(min(block_length, answer_length), block_buckets))
