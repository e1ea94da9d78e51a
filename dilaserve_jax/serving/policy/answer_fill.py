"""How much of its last block a request decodes before its answer ends (pure Python; no JAX).

A request asks for an answer area in whole blocks, but its answer may end (EOS) inside the last
one, and the positions after the end cost no steps of their own. The cluster controller prices a
request's steps from its area, so without this it counted the last block as full: on answer
lengths like the code trace's (median 15 positions in a 32-position area) that overstated a
request's steps by about half. The decoder here decodes every position of the area, so its
requests report a full last block and the estimate stays at its prior, 1."""
from __future__ import annotations

from collections import deque


class LastBlockFill:
    """Mean share of the last block decoded, over the last `window` finished requests."""

    def __init__(self, window: int = 256) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self._fills: deque[float] = deque(maxlen=window)
        self._sum = 0.0

    def observe(self, committed: int, answer_length: int, block_length: int) -> None:
        """A request finished with `committed` of its `answer_length` positions decoded."""
        if answer_length <= 0 or block_length <= 0:
            return
        blocks = -(-answer_length // block_length)
        last = min(block_length, answer_length - (blocks - 1) * block_length)  # the last block's size
        in_last = committed - (blocks - 1) * block_length
        fill = min(1.0, max(1.0 / last, in_last / last))
        if len(self._fills) == self._fills.maxlen:
            self._sum -= self._fills[0]
        self._fills.append(fill)
        self._sum += fill

    @property
    def count(self) -> int:
        return len(self._fills)

    @property
    def mean(self) -> float:
        """1.0 (a full last block) until a request has finished."""
        return self._sum / len(self._fills) if self._fills else 1.0


def pooled_fill(estimates) -> float | None:
    """Count-weighted mean of (mean, count) pairs over instances; None when none has finished any."""
    estimates = list(estimates)
    total = sum(c for _, c in estimates)
    return sum(m * c for m, c in estimates) / total if total else None
