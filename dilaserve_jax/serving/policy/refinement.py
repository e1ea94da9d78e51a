"""Refinement by replay: the analytic ranking's shortlist priced by what replays realise (pure;
no JAX, no simulator: the host supplies the replays).

The chain (capacity.py) ranks every candidate in milliseconds but is off by 5-10% of a layout's
capacity at its edge, which is where the choice matters. With `refine_candidates` K > 0 and a
`refiner` set (the simulator supplies one, `sim/refine.py`; serve has none), each decision keeps
only the current layout and the chain's best K, and prices them by replaying the last
`refine_window_s` of arrivals on each: model-predictive control. All of a shortlist is replayed on
one window, and the replays are reused for `refine_every_s` while the shortlist is the same.
"""
from __future__ import annotations

import time
from typing import Callable, Mapping, Sequence

from dilaserve_jax.core.layouts import layout_text
from dilaserve_jax.serving.policy.capacity import RequestShape
from dilaserve_jax.serving.policy.controller_config import ControllerConfig
from dilaserve_jax.serving.policy.layout_eval import LayoutPrediction

# refiner(layouts, [(arrival time, shape)], now) -> one LayoutPrediction per layout, in order
Refiner = Callable[[list[tuple[int, ...]], list[tuple[float, RequestShape]], float], Sequence[LayoutPrediction]]


class Refinement:
    def __init__(self, cfg: ControllerConfig, refiner: Refiner) -> None:
        self.cfg, self.refiner = cfg, refiner
        self._replays: tuple[float, dict] = (-float("inf"), {})
        self.seconds = 0.0  # wall time spent in replays

    def shortlist(self, now: float, current: tuple[int, ...], preds: Mapping[tuple[int, ...], LayoutPrediction],
                  arrivals: Callable[[float], list[tuple[float, RequestShape]]]) -> tuple[dict, str]:
        """(the shortlist's predictions, replayed where there were arrivals to replay, and a note for
        the decision's reason). `arrivals(since)`: the window's arrivals from that time on."""
        ref = preds[current].latency_s
        order = sorted(preds.values(), key=lambda p: (self.cfg.value(p.attainment, p.tau, p.latency_s, ref),
                                                      p.layout == current), reverse=True)
        short = list(dict.fromkeys([current, *(p.layout for p in order[:self.cfg.refine_candidates])]))
        when, replays = self._replays
        if now - when > self.cfg.refine_every_s or not set(short) <= set(replays):
            recent = arrivals(now - self.cfg.refine_window_s)
            if not recent:
                return dict(preds), ""
            t0 = time.perf_counter()
            replays = {p.layout: p for p in self.refiner(short, recent, now)}
            self.seconds += time.perf_counter() - t0
            self._replays, when = (now, replays), now
        out = {lay: replays.get(lay, preds[lay]) for lay in short}
        return out, f" [by replay at {when:.0f} s of {', '.join(layout_text(x) for x in short)}]"
