"""Measures a step-latency profile on the real compiled steps of one instance (executor code: JAX).

`measure_profile(runner_or_decoder, batches=, lengths=, blocks=)` times refresh and reuse steps over
the grid batch × canvas length × block length. For every grid point it admits dummy requests into
free slots (prompt + answer = the canvas length), runs the shape once untimed (compiles it if the
decoder was not warmed up, and warms caches), then takes the median of `repeats` timed steps, each
waited for with `jax.block_until_ready` on the decode state. Requests are admitted only when needed
(a refresh may run at any step), which keeps a small grid to seconds. A timed step goes through the decoder's
public `step` (host dispatch and the copy of the per-row outputs included): that is what a serving
step costs. τ = 1.0 commits one token per step, so one admission serves several reuse steps; a slot
whose block or request finishes (an EOS at the first answer position) is re-admitted with another
dummy prompt. The slots it used are released again afterwards.

The result is a `latency.Profile` ("analytic": false) labelled with the device kind and model name.
"""
from __future__ import annotations

import statistics
import sys
import time
from typing import Sequence

import jax
import numpy as np

from dilaserve_jax.decoding.decoder import SlotDecoder
from dilaserve_jax.serving.policy.latency import Profile, ProfilePoint
from dilaserve_jax.core.kinds import StepKind

_MAX_ATTEMPTS = 8  # dummy prompts tried before giving up on setting up a reuse step


def _decoder_of(runner_or_decoder) -> SlotDecoder:
    dec = getattr(runner_or_decoder, "decoder", runner_or_decoder)
    if not isinstance(dec, SlotDecoder):
        raise TypeError(f"expected a JaxRunner or SlotDecoder, got {type(runner_or_decoder).__name__}")
    return dec


def device_label(dec: SlotDecoder) -> str:
    devices = sorted(dec.devices, key=lambda d: d.id)
    return f"{len(devices)}x {devices[0].device_kind} ({devices[0].platform})"


def _answer_length(length: int, block: int) -> int | None:
    """Answer area for a dummy request on a canvas of `length`: whole blocks, about half the canvas,
    at least one prompt token; None when no block fits."""
    if block >= length:
        return None
    return min(block * max(1, (length // 2) // block), (length - 1) // block * block)


class _Dummies:
    """Dummy requests of one grid point in `slots`; re-admits with a fresh prompt when needed."""

    def __init__(self, dec: SlotDecoder, slots: list[int], length: int, answer: int, block: int, seed: int):
        cfg = dec.cfg
        reserved = {cfg.mask_id, cfg.eos_id, cfg.pad_id}
        self.ids = np.array([t for t in range(cfg.vocab_size) if t not in reserved])
        self.dec, self.slots, self.answer, self.block = dec, slots, answer, block
        self.prompt_len = length - answer
        self.rng = np.random.default_rng(seed)
        self.alive = self.reuse_ready = False  # alive: no slot's request has finished

    def admit(self) -> None:
        for s in self.slots:
            if not self.dec.is_free(s):
                self.dec.release(s)
            prompt = self.rng.choice(self.ids, size=self.prompt_len).tolist()
            self.dec.admit(s, prompt, self.answer, self.block)
        self.alive, self.reuse_ready = True, False

    def step(self, kind: StepKind) -> float:
        """One timed step over all slots; tracks whether a reuse step may follow."""
        taus = [1.0] * len(self.slots)
        t0 = time.perf_counter()
        out = self.dec.step(kind, self.slots, taus)
        jax.block_until_ready(self.dec.state)
        dt = time.perf_counter() - t0
        self.alive = not any(r.request_finished for r in out)
        self.reuse_ready = self.alive and not any(r.block_finished for r in out)
        return dt

    def prepare_refresh(self) -> None:
        if not self.alive:  # a refresh may run at any step of a live request: admit only when needed
            self.admit()

    def prepare_reuse(self) -> None:
        for _ in range(_MAX_ATTEMPTS):
            if self.reuse_ready:
                return
            self.admit()
            self.step(StepKind.REFRESH)
        raise RuntimeError(f"could not set up a reuse step for block {self.block}: every dummy request finished "
                           "its block at the refresh step (a block of 1 token cannot take reuse steps)")

    def release(self) -> None:
        for s in self.slots:
            if not self.dec.is_free(s):
                self.dec.release(s)


def measure_profile(runner_or_decoder, *, batches: Sequence[int], lengths: Sequence[int], blocks: Sequence[int],
                    repeats: int = 3, progress: bool = True, tp: int | None = None, model_name: str | None = None,
                    seed: int = 0) -> Profile:
    """Time the real refresh and reuse steps over batches × lengths × blocks (pairs with block >= length
    are skipped); one ProfilePoint per (kind, batch, length, block), the median of `repeats` runs.

    runner_or_decoder: a `serving.executor.runner.JaxRunner` or a `decoding.decoder.SlotDecoder`, idle enough
    to hold max(batches) dummy requests in free slots. tp defaults to the runner's TP degree (else
    the decoder's device count); model_name to the model config's name.
    """
    from tqdm.auto import tqdm

    dec = _decoder_of(runner_or_decoder)
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    batches, lengths, blocks = (tuple(sorted(set(int(x) for x in xs))) for xs in (batches, lengths, blocks))
    if not (batches and lengths and blocks) or min(batches + lengths + blocks) < 1:
        raise ValueError("batches, lengths and blocks must be non-empty and positive")
    free = [s for s in range(dec.num_slots) if dec.is_free(s)]
    if batches[-1] > len(free):
        raise ValueError(f"batch {batches[-1]} needs that many free slots; the decoder has {len(free)} "
                         f"free of {dec.num_slots}")
    if lengths[-1] > dec.config.max_length:
        raise ValueError(f"length {lengths[-1]} exceeds the decoder's largest length bucket {dec.config.max_length}")
    if blocks[-1] > dec.config.block_buckets[-1]:
        raise ValueError(f"block {blocks[-1]} exceeds the decoder's largest block bucket {dec.config.block_buckets[-1]}")
    grid = [(b, l, k, a) for l in lengths for k in blocks if (a := _answer_length(l, k)) for b in batches]
    if not grid:
        raise ValueError(f"no block in {blocks} fits a canvas length in {lengths}")
    tp = tp if tp is not None else getattr(runner_or_decoder, "tp_degree", None) or len(dec.devices)
    model = model_name or dec.cfg.name
    points: list[ProfilePoint] = []
    bar = tqdm(grid, desc="profiling steps", unit="shape", file=sys.stderr, disable=not progress)
    for i, (batch, length, block, answer) in enumerate(bar):
        bar.set_postfix_str(f"B{batch} L{length} K{block}")
        d = _Dummies(dec, free[:batch], length, answer, block, seed=[seed, i])
        try:
            refresh = []
            for r in range(repeats + 1):  # the first run warms (or compiles) the shape
                d.prepare_refresh()
                t = d.step(StepKind.REFRESH)
                if r:
                    refresh.append(t)
            reuse = []
            for r in range(repeats + 1):
                d.prepare_reuse()
                t = d.step(StepKind.REUSE)
                if r:
                    reuse.append(t)
        finally:
            d.release()
        for kind, ts in ((StepKind.REFRESH, refresh), (StepKind.REUSE, reuse)):
            points.append(ProfilePoint(kind, batch, length, block, tp, statistics.median(ts)))
    bar.close()
    device = device_label(dec)
    label = (f"measured: {model} on {device}, TP {tp}, cache {dec.config.cache_mode.value}, "
             f"median of {repeats}")
    return Profile(label, False, device, model, tuple(points))


def refresh_reuse_ratios(profile: Profile) -> dict[int, dict[int, float]]:
    """{canvas length: {batch: refresh / reuse time}} averaged (geometric mean) over blocks and TP."""
    by_key = {(p.kind, p.batch, p.canvas, p.block, p.tp): p.seconds for p in profile.points}
    acc: dict[int, dict[int, list[float]]] = {}
    for (kind, b, l, k, tp), s in by_key.items():
        reuse = by_key.get((StepKind.REUSE, b, l, k, tp))
        if kind == StepKind.REFRESH and reuse:
            acc.setdefault(l, {}).setdefault(b, []).append(s / reuse)
    return {l: {b: float(np.exp(np.mean(np.log(v)))) for b, v in sorted(row.items())} for l, row in sorted(acc.items())}
