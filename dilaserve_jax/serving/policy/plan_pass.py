"""One pass of the threshold controller's plan at a load cap, and the search for the cap.

A pass places each candidate (running requests first, then queued ones by deadline) on the
instance's slots: running ones now, queued ones when a slot frees, each at the highest of its
allowed τ (at or below the cap) that meets its deadline from its start. The controller
(`threshold.py`) builds the candidates, prices their durations lazily, and searches the caps for the
highest one whose pass keeps every request the lowest cap would keep (`boundary`).
These run many times a round, so the code avoids the costlier Python constructs (a frozen
dataclass per decision, `max`/`min` on two numbers) where the plan's inner loops are.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from functools import partial
from operator import attrgetter
from typing import Callable, Mapping, NamedTuple, Sequence

from dilaserve_jax.serving.policy.request import Request


class Decision(NamedTuple):  # (a plan makes hundreds a round: a tuple is built several times faster)
    tau: float
    at_risk: bool
    predicted_finish: float
    predicted_start: float  # now for running requests; when a slot frees for queued ones

    def slack_if_started(self, deadline: float, now: float) -> float:
        """Slack if it ran from now on (queue position left out, so order is not self-fulfilling)."""
        return deadline - (now + self.predicted_finish - self.predicted_start)


BY_DEADLINE = attrgetter("deadline", "arrival")
make_decision = partial(tuple.__new__, Decision)  # Decision(*fields) without the Python-level __new__ (passes build many)


@dataclass(slots=True)
class Candidate:
    """A request in one plan: its allowed τ, and what its remaining time at each is made of (the
    terms of `ThresholdController.remaining_time` that do not depend on τ, taken once)."""
    req: Request
    taus: Sequence[float]  # descending
    durs: list[float | None]  # predicted seconds to finish at each τ, priced when a pass first needs it
    running: bool
    per_refresh: float  # seconds per own refresh step (its batch plus the wait for the others' reuse)
    per_reuse: float  # seconds per own reuse step
    ratio: float  # its tokens per step against the average
    blocks: int  # blocks left, the current one counted
    masked: int  # masked positions in the current block
    n_refresh: int  # refresh steps left (the same at every τ)
    first: dict[float, int]  # cap -> `first_at_or_below(taus, cap)` for the grid's caps (shared by equal taus)


def first_at_or_below(taus: Sequence[float], cap: float) -> int:
    """Index of the highest τ at or below the cap in a descending list (the lowest when all are above)."""
    for i, t in enumerate(taus):
        if t <= cap:
            return i
    return len(taus) - 1


def schedule_pass(cands: list[Candidate], now: float, free: int, cap: float, may_miss: set[str] | None,
                  dur: Callable[[Candidate, int], float], preemptible: bool = False) -> dict[str, Decision] | None:
    """Each candidate's τ at this cap, in order, each queued one starting when a slot frees
    (`dur(c, i)`: its predicted seconds at its i-th τ, stored in `c.durs`).
    With `may_miss` (the floor's misses) the pass is a test of the cap: None as soon as a
    request outside it misses, or a queued one cannot run at the cap (its highest τ below it).
    `preemptible`: a running request that misses even at τ_min gives its slot up to a queued one
    in time (the scheduler preempts it), so its slot counts as free now."""
    slots = [now] * free  # times at which slots free up
    heapq.heapify(slots)
    out = {}
    push, pop = heapq.heappush, heapq.heappop
    for c in cands:
        if c.running:
            start = now
        elif slots:
            start = pop(slots)
        else:
            start = math.inf
        choice = None
        durs, deadline, taus = c.durs, c.req.deadline, c.taus
        last = len(taus) - 1
        # times only fall as τ does (rates are monotone), so if τ_min misses, every τ does
        d = durs[last]
        if start + (dur(c, last) if d is None else d) <= deadline:
            first = c.first.get(cap)
            for i in range(first_at_or_below(taus, cap) if first is None else first, last + 1):
                d = durs[i]
                if d is None:
                    d = dur(c, i)
                if start + d <= deadline:
                    choice = i
                    break
        if choice is None:  # hopeless even at τ_min: run fast when it runs, hold no place
            if may_miss is not None and c.req.id not in may_miss:
                return None
            d = durs[last]
            out[c.req.id] = make_decision((taus[last], True, start + d, start))
            if c.running:
                push(slots, now if preemptible else now + d)
            elif start != math.inf:
                push(slots, start)
        else:
            t = taus[choice]
            top = taus[0]
            if may_miss is not None and not c.running and t < (cap if cap < top else top) - 1e-9:
                return None
            out[c.req.id] = make_decision((t, False, start + d, start))
            push(slots, start + d)
    return out


def boundary(passes: Callable[[int], bool], start: int, n: int) -> int | None:
    """The lowest i in [0, n) with passes(i), for a test that, once it passes, passes for every
    higher i (None if none does), tested outwards from `start` with a doubling step, then bisected."""
    step = 1
    if passes(start):
        best, failed = start, -1
        while best > 0:  # look lower
            j = best - step if best - step > 0 else 0
            if not passes(j):
                failed = j
                break
            best, step = j, step * 2
    else:
        best, failed = None, start
        while failed < n - 1:  # look higher
            j = failed + step if failed + step < n - 1 else n - 1
            if passes(j):
                best = j
                break
            failed, step = j, step * 2
        if best is None:
            return None
    lo, hi = failed + 1, best - 1  # the boundary lies in (failed, best]
    while lo <= hi:
        mid = (lo + hi) // 2
        if passes(mid):
            best, hi = mid, mid - 1
        else:
            lo = mid + 1
    return best




def misses(res: Mapping[str, Decision]) -> set[str]:
    return {rid for rid, d in res.items() if d.at_risk}
