"""Offline batch generation on a SlotDecoder: evaluation and benchmarks without the serving stack.

Keeps every slot busy: admits requests as slots free up; each round runs one refresh step over the
slots that need one and one reuse step over the others (cache mode none: one full step over all).
"""
from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from dilaserve_jax.core.kinds import StepKind, CacheMode
from dilaserve_jax.decoding.decoder import SlotDecoder


@dataclass(frozen=True, slots=True)
class DecodeRequest:
    prompt: tuple[int, ...]
    answer_length: int
    block_length: int
    tau: float = 1.0
    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "prompt", tuple(int(t) for t in self.prompt))
        if not self.prompt or self.answer_length < 1 or self.block_length < 1:
            raise ValueError("need a non-empty prompt and positive answer and block lengths")
        if not 0.0 < self.tau <= 1.0:
            raise ValueError(f"τ must be in (0, 1], got {self.tau}")


@dataclass(slots=True)
class DecodeResult:
    answer: list[int]  # committed tokens before the first EOS
    steps: int  # steps this request took part in
    refresh_steps: int
    committed: int  # canvas positions committed (EOS included)
    per_step: list[int] = field(default_factory=list)  # positions committed by each of its steps, in order


@dataclass(slots=True)
class BatchStats:
    """Totals of one generate_many call; step times are wall-clock including the host round trip."""

    wall_seconds: float = 0.0
    refresh_seconds: list[float] = field(default_factory=list)
    reuse_seconds: list[float] = field(default_factory=list)
    committed: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.committed / self.wall_seconds if self.wall_seconds else 0.0


def generate_many(decoder: SlotDecoder, requests: Sequence[DecodeRequest], *, max_batch: int | None = None,
                  progress: bool = False) -> tuple[list[DecodeResult], BatchStats]:
    """Decode every request to completion, at most `max_batch` at a time (default: every slot);
    results in request order."""
    from tqdm.auto import tqdm

    width = decoder.num_slots if max_batch is None else max_batch
    if not 1 <= width <= decoder.num_slots:
        raise ValueError(f"max_batch must be in [1, {decoder.num_slots}], got {max_batch}")
    results: list[DecodeResult | None] = [None] * len(requests)
    pending = deque(enumerate(requests))
    active: dict[int, int] = {}  # slot -> request index
    counts: dict[int, list[int]] = {}  # slot -> [steps, refresh steps, committed]
    per_step: dict[int, list[int]] = {}  # slot -> positions committed by each step
    stats = BatchStats()
    full_only = decoder.config.cache_mode is CacheMode.NONE
    bar = tqdm(total=len(requests), desc="decoding", unit="req", file=sys.stderr, disable=not progress)
    start = time.perf_counter()

    def run(refresh: bool, slots: list[int]) -> None:
        t0 = time.perf_counter()
        outs = decoder.step(StepKind.REFRESH if refresh else StepKind.REUSE, slots, [requests[active[s]].tau for s in slots])
        (stats.refresh_seconds if refresh else stats.reuse_seconds).append(time.perf_counter() - t0)
        for out in outs:
            c = counts[out.slot]
            c[0] += 1
            c[1] += refresh
            c[2] += out.n_committed
            per_step[out.slot].append(out.n_committed)
            stats.committed += out.n_committed
            if out.request_finished:
                i = active.pop(out.slot)
                results[i] = DecodeResult(decoder.answer(out.slot), *c, per_step.pop(out.slot))
                decoder.release(out.slot)
                bar.update(1)

    while pending or active:
        for slot in range(width):
            if pending and slot not in active:
                i, req = pending.popleft()
                decoder.admit(slot, req.prompt, req.answer_length, req.block_length,
                              temperature=req.temperature, seed=req.seed)
                active[slot], counts[slot], per_step[slot] = i, [0, 0, 0], []
        if full_only:
            run(True, sorted(active))
            continue
        refresh = [s for s in sorted(active) if decoder.needs_refresh(s)]
        reuse = [s for s in sorted(active) if s not in refresh]
        if refresh:
            run(True, refresh)
        if reuse:
            run(False, reuse)
    stats.wall_seconds = time.perf_counter() - start
    bar.close()
    return results, stats  # type: ignore[return-value]
