"""A runner without a model: simulates committing tokens and the passage of time (tests, demos).

Tokens committed per step depend on τ and a per-request difficulty (lower τ → more tokens; harder
→ fewer), through a deterministic accumulator so runs are reproducible. Each step advances a
`FakeClock` by a step time that, like the real steps, makes a refresh several times a reuse and
grows with batch and canvas length; or, with `real_sleep`, really sleeps that long (to measure
thread overlap). `confidence(prompt)` gives the confidence histogram every step reports for the
slot (the threshold controller's risk evidence); by default none is reported.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from dilaserve_jax.serving.policy.latency import Profile, ProfilePoint
from dilaserve_jax.core.outcome import SlotOutcome
from dilaserve_jax.core.kinds import StepKind

StepTimeFn = Callable[[StepKind, int, int, int], float]  # (kind, batch, canvas, block) -> seconds

# tokens/step at difficulty 1 (same shape as threshold.DEFAULT_PRIOR, kept separate on purpose:
# tests check that the controller learns rates it was not told)
FAKE_RATES = ((0.3, 6.8), (0.4, 5.6), (0.5, 4.7), (0.6, 3.9), (0.7, 3.2), (0.8, 2.6), (0.9, 2.0),
              (0.95, 1.6), (1.0, 1.0))


def default_step_time(kind: StepKind, batch: int, canvas: int, block: int) -> float:
    if kind == StepKind.REFRESH:
        return 2e-3 + 1e-5 * batch * canvas + 1e-9 * batch * canvas * canvas
    return 1e-3 + 4e-6 * batch * block + 2e-8 * batch * canvas


def fake_profile(step_time: StepTimeFn = default_step_time, batches: Sequence[int] = (1, 2, 4, 8, 16),
                 canvases: Sequence[int] = (64, 128, 256, 512), blocks: Sequence[int] = (8, 16, 32),
                 tp: int = 1) -> Profile:
    pts = tuple(ProfilePoint(k, b, l, blk, tp, step_time(k, b, l, blk))
                for k in StepKind for b in batches for l in canvases for blk in blocks if blk < l)
    return Profile("synthetic profile of the fake runner (not measured)", True, "fake", "fake", pts)


def tp_step_time(tp: int, serial: float = 0.25, comm_s: float = 2e-4,
                 base: StepTimeFn = default_step_time) -> StepTimeFn:
    """A synthetic TP-`tp` step time: the parallel part of `base` divided by tp, a serial share
    that is not, plus an all-reduce cost when tp > 1 — wide instances finish one request sooner,
    many narrow ones serve more in all (the trade-off the cluster controller manages)."""
    def step_time(kind: StepKind, batch: int, canvas: int, block: int) -> float:
        return base(kind, batch, canvas, block) * (serial + (1 - serial) / tp) + (comm_s if tp > 1 else 0.0)
    return step_time


def fake_tp_profile(tps: Sequence[int] = (1, 2, 4, 8), **kw) -> Profile:
    """`fake_profile` for several TP degrees (synthetic, labelled so; see `tp_step_time`)."""
    pts = tuple(p for tp in tps for p in fake_profile(tp_step_time(tp, **kw), tp=tp).points)
    return Profile("synthetic multi-TP profile of the fake runner (not measured)", True, "fake", "fake", pts)


class FakeClock:
    """A manually advanced clock (thread-safe)."""

    def __init__(self, start: float = 0.0) -> None:
        self._t = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._t

    def advance(self, dt: float) -> None:
        if dt < 0:
            raise ValueError("time runs forward")
        with self._lock:
            self._t += dt


def _rate(tau: float) -> float:
    pts = FAKE_RATES
    if tau <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if tau <= x1:
            return y0 + (y1 - y0) * (tau - x0) / (x1 - x0)
    return 1.0


@dataclass(slots=True)
class _Slot:
    prompt: tuple[int, ...]
    answer_length: int
    block_length: int
    difficulty: float
    tokens: list[int | None] = field(default_factory=list)
    committed: int = 0
    credit: float = 0.0
    needs_refresh: bool = True


def check_step(kind: StepKind, slots: Sequence[int], taus: Sequence[float], blocks: Sequence[int] | None,
               table: dict, where: Callable[[object], tuple[int, bool]]) -> list:
    """The Runner contract a test double enforces on one step: one τ per slot, admitted slots, and
    each slot's (current block, needs a refresh) as its canvas says — `where(state)` — agreeing
    with the plan's block and step kind. Returns the slots' states from `table`."""
    if not slots or len(slots) != len(taus):
        raise ValueError("need one τ per slot and at least one slot")
    states = [table[s] for s in slots]  # KeyError: not admitted
    for s, st, b in zip(slots, states, blocks if blocks is not None else [None] * len(slots)):
        block, needs_refresh = where(st)
        if b is not None and b != block:
            raise ValueError(f"slot {s}: the plan says block {b}, its canvas is in block {block}")
        if needs_refresh != (kind == StepKind.REFRESH):
            raise ValueError(f"slot {s} needs {'REFRESH' if needs_refresh else 'REUSE'}, got {kind.name}")
    return states


class FakeRunner:
    """Implements `types.Runner`. Enforces the protocol (admitted slots, right step kind)."""

    def __init__(self, num_slots: int, clock: FakeClock | None = None, tp_degree: int = 1,
                 step_time: StepTimeFn = default_step_time,
                 difficulty: Callable[[Sequence[int]], float] = lambda prompt: 1.0,
                 real_sleep: bool = False,
                 confidence: Callable[[Sequence[int]], Sequence[int]] | None = None) -> None:
        if num_slots < 1:
            raise ValueError("num_slots must be >= 1")
        self.num_slots, self.tp_degree = num_slots, tp_degree
        self.clock = clock if clock is not None else FakeClock()
        self.step_time, self.difficulty, self.real_sleep = step_time, difficulty, real_sleep
        self.confidence = confidence
        self.slots: dict[int, _Slot] = {}
        self.steps_run: list[tuple[StepKind, tuple[int, ...], tuple[float, ...]]] = []
        self.weights = 0  # "weights": token values depend on it, so a reload changes answers

    def admit(self, slot: int, prompt_tokens: Sequence[int], answer_length: int, block_length: int, *,
              temperature: float = 0.0, seed: int = 0, committed: Sequence[int | None] | None = None,
              steps_done: int = 0) -> None:
        if not 0 <= slot < self.num_slots or slot in self.slots:
            raise ValueError(f"slot {slot} is out of range or occupied")
        prompt = tuple(prompt_tokens)
        st = _Slot(prompt, answer_length, block_length, float(self.difficulty(prompt)), [None] * answer_length)
        if committed is not None:  # resume: commits are in position order, so a prefix is filled
            if len(committed) != answer_length:
                raise ValueError(f"committed has {len(committed)} positions, answer_length {answer_length}")
            st.committed = next((i for i, t in enumerate(committed) if t is None), answer_length)
            st.tokens[:st.committed] = committed[:st.committed]
        self.slots[slot] = st

    def reload(self, params) -> None:
        """New "weights": later tokens change; every slot's next step must refresh (as the real runner)."""
        self.weights = int(params)
        for st in self.slots.values():
            st.needs_refresh = True

    def release(self, slot: int) -> None:
        if self.slots.pop(slot, None) is None:
            raise ValueError(f"slot {slot} is not admitted")

    def step(self, kind: StepKind, slots: Sequence[int], taus: Sequence[float],
             blocks: Sequence[int] | None = None) -> list[SlotOutcome]:
        states = check_step(kind, slots, taus, blocks, self.slots,
                            lambda st: (st.committed // st.block_length, st.needs_refresh))
        for s, st in zip(slots, states):
            if st.committed >= st.answer_length:
                raise ValueError(f"slot {s} is already finished")
        canvas = max(len(st.prompt) + st.answer_length for st in states)
        block = max(st.block_length for st in states)
        dt = self.step_time(kind, len(slots), canvas, block)
        out = [self._advance(s, st, tau) for s, st, tau in zip(slots, states, taus)]
        self.steps_run.append((kind, tuple(slots), tuple(taus)))
        if self.real_sleep:
            time.sleep(dt)
        else:
            self.clock.advance(dt)
        return out

    def _advance(self, slot: int, st: _Slot, tau: float) -> SlotOutcome:
        block_end = (st.committed // st.block_length + 1) * st.block_length
        st.credit += 1.0 + (_rate(tau) - 1.0) / st.difficulty
        n = max(1, int(st.credit))
        st.credit -= n
        n = min(n, block_end - st.committed)
        positions = tuple(range(st.committed, st.committed + n))
        tokens = tuple(10 + (sum(st.prompt) * 31 + p * 7 + self.weights * 13) % 1000 for p in positions)
        for p, t in zip(positions, tokens):
            st.tokens[p] = t
        st.committed += n
        block_finished = st.committed == block_end
        st.needs_refresh = block_finished
        counts = tuple(self.confidence(st.prompt)) if self.confidence is not None else ()
        finished = st.committed >= st.answer_length
        return SlotOutcome(slot, positions, tokens, n, min(1.0, tau + 0.05), block_finished, finished, counts,
                           tuple(t for t in st.tokens if t is not None) if finished else None)

