"""The modelled executor: a `Runner` whose steps cost modelled time on a virtual clock.

`ModelledRunner` implements `serving.policy.types.Runner` (admit / release / step / answer) like
`JaxRunner`, with no model behind it: a step advances the instance's `VirtualClock` by the step
time (`StepTimeModel`: a latency profile, optionally bucketed like the real decoder's padded shapes,
times a noise factor, plus a per-iteration host overhead), and each slot commits the positions its
request's `quality.RequestPlan` says. The engine, scheduler and threshold controller that drive it
are the real ones, unchanged.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import numpy as np

from dilaserve_jax.serving.cluster.fake_runner import FakeClock, check_step
from dilaserve_jax.serving.policy.latency import LatencyModel, Profile
from dilaserve_jax.core.buckets import padded
from dilaserve_jax.core.outcome import SlotOutcome
from dilaserve_jax.core.kinds import StepKind
from dilaserve_jax.sim.quality import Progress, QualityModel, RequestPlan

if TYPE_CHECKING:
    from dilaserve_jax.sim.host_time import HostTimeModel
    from dilaserve_jax.sim.step_stats import StepStats

TOKEN = 1  # the modelled runner's stand-in token id (answers are counted, not read)


class VirtualClock(FakeClock):
    """An instance's clock in simulated seconds; the simulator moves it to the next event."""

    def set(self, t: float) -> None:
        now = self()
        if t < now - 1e-12:
            raise ValueError(f"virtual time runs forward: {t} < {now}")
        self.advance(max(0.0, t - now))


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    """Seconds of one batched step on an instance of TP `tp`.

    latency: fitted model (always); table: measured points keyed (kind, tp, batch, canvas, block),
    used exactly where a step's padded shape was measured; batch/length buckets pad shapes as the
    real decoder does (empty: no padding); noise: a log-normal sigma (float) or measured ratios of
    actual to predicted step time to resample; overhead_s: host time per iteration (scheduling,
    admission, publishing) charged with each step."""

    latency: LatencyModel
    table: Mapping[tuple[int, int, int, int, int], float] = field(default_factory=dict)
    batch_buckets: tuple[int, ...] = ()
    length_buckets: tuple[int, ...] = ()
    noise: float | tuple[float, ...] = 0.0
    overhead_s: float = 0.0
    # (seconds from the start, factor): a measured slowdown over time (a shared host's contention),
    # replayed instead of `noise`: from each entry's time on, work runs `factor` times slower
    timeline: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.noise, float) and self.noise < 0:
            raise ValueError("noise sigma must be >= 0")
        if not isinstance(self.noise, float) and (not self.noise or min(self.noise) <= 0):
            raise ValueError("noise ratios must be a non-empty list of positive numbers")
        if self.overhead_s < 0:
            raise ValueError("overhead must be >= 0")

    @classmethod
    def from_profile(cls, profile: Profile, *, measured_points: bool = True, **kw) -> "StepTimeModel":
        table = {(int(p.kind), p.tp, p.batch, p.canvas, p.block): p.seconds for p in profile.points} \
            if measured_points else {}
        return cls(LatencyModel.from_profile(profile), table, **kw)

    def mean(self, kind: StepKind, batch: int, canvas: int, block: int, tp: int) -> float:
        b, l = padded(batch, self.batch_buckets), padded(canvas, self.length_buckets)
        t = self.table.get((int(kind), tp, b, l, block))
        if t is None:
            t = self.latency.predict(kind, b, l, block, tp)
        return t + self.overhead_s

    def _stretched(self, start: float, work: float) -> float:
        """Seconds that `work` nominal seconds take from `start` under the slowdown timeline."""
        tl = self.timeline
        i = max(0, bisect.bisect_right(tl, (start, math.inf)) - 1)
        t, left = start, work
        while True:
            factor = max(tl[i][1], 1e-6)
            end = tl[i + 1][0] if i + 1 < len(tl) else math.inf
            if left * factor <= end - t:
                return t + left * factor - start
            left -= (end - t) / factor
            t, i = end, i + 1

    def batch_seconds(self, kind: StepKind, shapes: Sequence[tuple[int, int]], tp: int, rng: np.random.Generator,
                      now: float = 0.0) -> float:
        """One step over requests of (canvas, block) shapes. With length buckets, as the real decoder
        runs it: one compiled step per (length bucket, block) group, back to back; without, one step
        padded to the longest canvas. Noise multiplies the step, the overhead is added once."""
        if self.length_buckets:
            groups: dict[tuple[int, int], int] = {}
            for canvas, block in shapes:
                key = (padded(canvas, self.length_buckets), block)
                groups[key] = groups.get(key, 0) + 1
            t = sum(self.mean(kind, n, l, k, tp) - self.overhead_s for (l, k), n in groups.items())
        else:
            t = self.mean(kind, len(shapes), max(c for c, _ in shapes), max(k for _, k in shapes), tp) - self.overhead_s
        if self.timeline:
            return self._stretched(now, t) + self.overhead_s
        if isinstance(self.noise, float):
            f = 1.0 if self.noise == 0 else math.exp(self.noise * rng.standard_normal() - self.noise ** 2 / 2)
        else:
            f = self.noise[int(rng.integers(len(self.noise)))]
        return t * f + self.overhead_s


@dataclass(slots=True)
class _Slot:
    plan: RequestPlan
    prompt_len: int
    progress: Progress
    needs_refresh: bool = True


class ModelledRunner:
    """Implements `types.Runner` with modelled time and commits (see module doc).

    A request is identified by its admission `seed`, the key of its `RequestPlan` in `plans` (the
    simulator assigns every request a distinct seed; the real runner uses it only when sampling
    at temperature > 0, which the simulated workloads never ask for)."""

    def __init__(self, num_slots: int, tp_degree: int, clock: VirtualClock, step_time: StepTimeModel,
                 quality: QualityModel, plans: Mapping[int, RequestPlan], seed: int = 0,
                 host_time: "HostTimeModel | None" = None, stats: "StepStats | None" = None) -> None:
        """host_time: host seconds charged with each step on (batch, `queue_depth()`), besides the step
        model's constant `overhead_s` (`sim/host_time.py`); stats: where each step is counted
        (`sim/step_stats.py`)."""
        if num_slots < 1:
            raise ValueError("num_slots must be >= 1")
        self.num_slots, self.tp_degree, self.clock = num_slots, tp_degree, clock
        self.step_time, self.quality, self.plans = step_time, quality, plans
        self.slots: dict[int, _Slot] = {}
        self.rng = np.random.default_rng([seed, tp_degree, 11])
        self.steps_run = 0
        self.busy_s = 0.0
        self.host_time = host_time
        self.stats = stats
        self.queue_depth: Callable[[], int] = lambda: 0  # set by the simulator: the scheduler's waiting count
        self.last_host_s = 0.0  # host time charged with the last step (the iteration trace's)

    def admit(self, slot: int, prompt_tokens: Sequence[int], answer_length: int, block_length: int, *,
              temperature: float = 0.0, seed: int = 0, committed: Sequence[int | None] | None = None,
              steps_done: int = 0) -> None:
        if not 0 <= slot < self.num_slots or slot in self.slots:
            raise ValueError(f"slot {slot} is out of range or occupied")
        plan = self.plans.get(seed)
        if plan is None:
            raise KeyError(f"no request plan for seed {seed}")
        if plan.answer_length != answer_length or plan.block_length != block_length:
            raise ValueError(f"request {seed}: admitted with answer {answer_length}/block {block_length}, "
                             f"planned {plan.answer_length}/{plan.block_length}")
        done = 0
        if committed is not None:  # resume: commits are in position order here, so a prefix is filled
            done = next((i for i, t in enumerate(committed) if t is None), answer_length)
        prog = Progress(done // block_length, done % block_length, done, steps_done)
        self.slots[slot] = _Slot(plan, len(prompt_tokens), prog)

    def release(self, slot: int) -> None:
        if self.slots.pop(slot, None) is None:
            raise ValueError(f"slot {slot} is not admitted")

    def step(self, kind: StepKind, slots: Sequence[int], taus: Sequence[float],
             blocks: Sequence[int] | None = None) -> list[SlotOutcome]:
        states = check_step(kind, slots, taus, blocks, self.slots, lambda st: (st.progress.block, st.needs_refresh))
        dt = self.step_time.batch_seconds(kind, [(st.prompt_len + st.plan.answer_length, st.plan.block_length)
                                                 for st in states], self.tp_degree, self.rng, self.clock())
        host = 0.0 if self.host_time is None else self.host_time.sample(len(slots), self.queue_depth(), self.rng)
        self.last_host_s = host + self.step_time.overhead_s
        dt += host
        out = [self._advance(s, st, tau) for s, st, tau in zip(slots, states, taus)]
        self.clock.advance(dt)
        self.steps_run += 1
        self.busy_s += dt
        if self.stats is not None:
            self.stats.record(self.tp_degree, kind, len(slots), dt)
        return out

    def _advance(self, slot: int, st: _Slot, tau: float) -> SlotOutcome:
        opening = st.progress.committed == 0  # its first step: the histogram the budget's evidence comes from
        first, n, block_done, finished = advance(self.quality, st.plan, st.progress, tau)
        st.needs_refresh = block_done
        answer = (TOKEN,) * st.progress.committed if finished else None
        return SlotOutcome(slot, tuple(range(first, first + n)), (TOKEN,) * n, n, min(1.0, tau + 0.05), block_done,
                           finished, st.plan.first_counts if opening else (), answer)


def advance(quality: QualityModel, plan: RequestPlan, prog: Progress, tau: float) -> tuple[int, int, bool, bool]:
    """One step of one request at τ: commits the positions the quality model says, never past the
    block (the commit rule works within the current block), at least one (the argmax always
    commits). Returns (first position, count, block finished, request finished)."""
    n, block_done, finished = quality.commit(plan, prog, tau)
    block_end = min(plan.answer_length, (prog.block + 1) * plan.block_length)
    first = prog.committed
    n = max(1, min(n, block_end - first))
    if first + n >= block_end:
        block_done = True
        finished = finished or block_end >= plan.answer_length
    prog.committed += n
    prog.steps += 1
    if block_done:
        prog.block += 1
        prog.in_block = 0
    else:
        prog.in_block += n
    return first, n, block_done, finished


