"""The cluster controller over several hosts: candidate layouts per host, and a switch that
changes only the hosts it must (pure; no JAX, no Ray).

`HostsController` is the `ClusterController` (serving/policy/controller.py) with three things
made per host; the load estimate, the prediction, the objective, the hysteresis, the dwell time
and the migrations are the one-host controller's own:

- **Candidates.** Each live host's devices partitioned into power-of-two TP groups (a TP group
  never spans hosts), or the `--layouts` that cover that host's devices; the candidates are the
  distinct sets of instances these make over all hosts (`core.host_layouts.flat_candidates`). The
  router spreads requests over every instance, wherever it runs, so the prediction needs the
  instances only. Recomputed when a host joins or is lost.
- **Which hosts change.** The chosen instances go to the hosts as the hosts layout that changes
  the fewest hosts, then moves the fewest bytes (`assign_to_hosts`): a host whose layout already
  fits keeps its instances and requests untouched. The decision reads per host ("2x1|1x2"), which
  is what `Cluster.reconfigure` takes across hosts.
- **Switching cost.** The slowest of the hosts that change (their workers build at the same
  time): the bytes each reshards on its own devices at `bandwidth_gbps`, and `load_s` plus
  `compile_s` for each of its placements that its old layout did not run. Hosts left as they are
  cost nothing.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from dilaserve_jax.core.host_layouts import (MAX_CANDIDATES, HostsLayout, assign_to_hosts, changed_hosts,
                                             flat_candidates, flatten, host_partitions, hosts_layout_text)
from dilaserve_jax.core.layouts import moved_fraction, parse_layout
from dilaserve_jax.serving.policy.capacity import RequestShape, StepShapes
from dilaserve_jax.serving.policy.controller import ClusterController, ControllerConfig, Decision
from dilaserve_jax.serving.policy.switch_cost import build_seconds
from dilaserve_jax.serving.policy.latency import LatencyModel


@dataclass(frozen=True, slots=True)
class HostSlice:
    """One live host as the controller sees it: its devices and the TP degrees it runs now."""

    host: str
    devices: int
    layout: tuple[int, ...]  # its instances' TP degrees, failed ones included


@dataclass(frozen=True, slots=True)
class ControlInputs:
    """What a host's worker measured and knows for the controller (it travels to the leader)."""

    devices: int
    tp_degrees: tuple[int, ...]  # the degrees it may run, each with a latency model
    latency: Mapping[int, LatencyModel]
    slots: int
    param_bytes: int
    tau_floor: float
    prior: Mapping[float, float] = field(default_factory=dict)  # τ -> tokens/step
    shapes: StepShapes | None = None  # how its decoders batch (None: one batch at each request's canvas)
    pressure_share: float | None = None  # its instances' arrival-pressure share (None: the rule is off)


class HostsController(ClusterController):
    def __init__(self, cfg: ControllerConfig, *, hosts: Callable[[], Sequence[HostSlice]], tp_degrees: Sequence[int],
                 latency: LatencyModel | Mapping[int, LatencyModel], slots: int, param_bytes: int,
                 layouts: Sequence[str] | None = None, tau_floor: float = 0.5,
                 prior: Mapping[float, float] | None = None, shapes: StepShapes | None = None,
                 max_candidates: int = MAX_CANDIDATES, pressure_share: float | None = None) -> None:
        """`hosts()`: the live hosts in the order `Cluster.reconfigure` takes their parts;
        `layouts`: mesh specs a host may run (each host those that cover its devices)."""
        live = list(hosts())
        if not live:
            raise ValueError("no live host to control")
        super().__init__(cfg, num_devices=max(h.devices for h in live), tp_degrees=tp_degrees, latency=latency,
                         slots=slots, param_bytes=param_bytes, tau_floor=tau_floor, prior=prior, shapes=shapes,
                         pressure_share=pressure_share)
        self.hosts_now, self.allowed, self.max_candidates = hosts, tuple(layouts or ()), max_candidates
        self._flat: dict[tuple, list[tuple[int, ...]]] = {}  # per-host options -> candidates
        self._current: HostsLayout = ()
        self._options: list[list[tuple[int, ...]]] = []
        self._look(live)

    def decide(self, now: float, current: Sequence[int], *, in_flight_slack: Sequence[float] = (),
               compiled: frozenset[tuple[int, int]] = frozenset(),
               realised: tuple[int, int] | None = None,
               realised_latency: tuple[float, int] | None = None) -> Decision:
        """As `ClusterController.decide` (`current`: the healthy instances' TP degrees), over the
        live hosts' candidates; the decision's layouts read per host."""
        live = list(self.hosts_now())
        if not live or any(not h.layout for h in live):
            text = "|".join(hosts_layout_text([h.layout]) if h.layout else "-" for h in live) or "-"
            return self._record(Decision(now, text, text, False, "a host is joining (no instances yet)", 0.0))
        self._look(live)
        decision = super().decide(now, current, in_flight_slack=in_flight_slack, compiled=compiled,
                                  realised=realised, realised_latency=realised_latency)
        per_host = self._on_hosts(decision)
        self.history[-1] = per_host
        return per_host

    def hosts_layout(self, flat: Sequence[int]) -> HostsLayout | None:
        """The hosts layout with instances `flat` that changes the fewest live hosts."""
        if tuple(sorted(flat, reverse=True)) == flatten(self._current):
            return self._current
        return assign_to_hosts(tuple(flat), self._current, self._options)

    def switch_seconds(self, old: Sequence[int], new: Sequence[int], sample: Sequence[RequestShape],
                       compiled: frozenset[tuple[int, int]] = frozenset()) -> tuple[float, float]:
        """(seconds until the changed hosts serve their new layouts, pause of the requests in flight)."""
        _, pause_s = super().switch_seconds(old, new, sample, compiled)
        target = self.hosts_layout(new)
        if target is None:  # not a layout these hosts can run
            return float("inf"), pause_s
        seconds = 0.0
        for i in changed_hosts(self._current, target):
            was, will = self._current[i], target[i]
            move_bytes = moved_fraction(was, will) * self.param_bytes / max(will)
            # each host compiles its own new placements (no compiled set is shared across hosts)
            seconds = max(seconds, move_bytes / (self.cfg.bandwidth_gbps * 1e9)
                          + build_seconds(was, will, frozenset(), self.cfg))
        return seconds, pause_s

    # --- internals ---
    def _look(self, live: Sequence[HostSlice]) -> None:
        """The live hosts' layouts now and the candidates over them."""
        self._current = tuple(tuple(sorted(h.layout, reverse=True)) for h in live)
        self._options = [host_partitions(h.devices, self.tp_degrees, self.allowed) or [cur]
                         for h, cur in zip(live, self._current)]
        key = tuple(tuple(o) for o in self._options)
        if key not in self._flat:
            self._flat = {key: flat_candidates(self._options, self.max_candidates)}
        self.candidates = self._flat[key]
        self.num_devices = sum(h.devices for h in live)

    def _on_hosts(self, d: Decision) -> Decision:
        chosen = self._current if d.chosen == d.current else self.hosts_layout(parse_layout(d.chosen))
        if chosen is None:
            return dataclasses.replace(d, switch=False, reason=f"{d.chosen} does not fit the hosts")
        cur_text, new_text = hosts_layout_text(self._current), hosts_layout_text(chosen)
        names = {d.current: cur_text, d.chosen: new_text}
        predicted = {names.get(k, k): v for k, v in d.predicted.items()}
        return dataclasses.replace(d, current=cur_text, chosen=new_text, predicted=predicted)
