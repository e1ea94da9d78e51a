"""Runs the cluster controller against a live cluster: observe, decide, actuate.

Modes: `auto` (a thread calls `round()` every `interval_s`), `paused` (the thread idles; manual
`Reconfigure` calls are allowed) and `manual` (no thread). `round(now)` is one pass and can be
driven by hand (tests, the simulator): it feeds the controller the instances' published τ ->
tokens/step estimate and in-flight deadlines, applies a layout switch through
`Cluster.reconfigure`, and moves at-risk requests to instances with spare capacity through
`Cluster.migrate`. Everything it reads is an immutable engine snapshot. It works over the
`ServingCluster` protocol (serving/cluster/protocol.py), so the simulator's cluster runs it too.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from dilaserve_jax.serving.cluster.protocol import ServingCluster
from dilaserve_jax.serving.cluster.state import ControllerState
from dilaserve_jax.serving.policy.answer_fill import pooled_fill
from dilaserve_jax.serving.policy.capacity import RequestShape
from dilaserve_jax.serving.policy.controller import AtRisk, ClusterController, Decision, Migration
from dilaserve_jax.serving.policy.outcomes import realised, realised_latency
from dilaserve_jax.serving.policy.request import Request

log = logging.getLogger(__name__)
MODES = ("auto", "paused", "manual")


class Autoscaler:
    def __init__(self, cluster: ServingCluster, controller: ClusterController | None, mode: str = "auto",
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`controller` may come later (`set_controller`), e.g. once its latency models are measured."""
        if mode not in MODES:
            raise ValueError(f"controller mode must be one of {MODES}, got {mode!r}")
        self.cluster, self.controller, self.clock = cluster, controller, clock
        self._mode = mode
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.migrations: list[tuple[float, Migration]] = []
        cluster.add_arrival_observer(self._observe)

    def set_controller(self, controller: ClusterController) -> None:
        self.controller = controller
        if self._mode != "manual":
            self.start()

    @property
    def mode(self) -> str:
        return self._mode

    def set_mode(self, mode: str) -> None:
        """auto <-> paused at run time (manual has no thread: it is chosen at start-up)."""
        if mode not in ("auto", "paused") or self._mode == "manual":
            raise ValueError(f"can switch between auto and paused only (now {self._mode})")
        self._mode = mode

    @property
    def manual_allowed(self) -> bool:
        return self._mode != "auto"

    def state(self) -> ControllerState:
        """Its mode, latest decisions and the requests it moved lately (for the cluster state)."""
        decisions = list(self.controller.history)[-8:] if self.controller is not None else []
        moved = [f"{m.request_id}: {m.source} -> {m.target} ({m.reason})" for _, m in self.migrations[-8:]]
        return ControllerState(self._mode, tuple(map(str, decisions)), tuple(moved))

    def _observe(self, req: Request, now: float) -> None:
        if self.controller is None:
            return
        self.controller.observe(RequestShape(len(req.prompt_tokens), req.answer_length, req.block_length,
                                             req.deadline - req.arrival, req.tau_min, req.tau_max), now)

    # --- the loop ---
    def start(self) -> "Autoscaler":
        if self._mode != "manual" and self._thread is None and self.controller is not None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="cluster-controller", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self._thread = None

    @property
    def alive(self) -> bool:
        """Its thread still runs (after `stop`: a layout switch it started is still compiling)."""
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        while not self._stop.wait(self.controller.cfg.interval_s):
            if self._mode != "auto" or not self.cluster.ready:
                continue
            try:
                self.round(self.clock())
            except Exception:  # noqa: BLE001 - a failed round must not end control
                log.exception("controller round failed")

    def round(self, now: float) -> Decision | None:
        cluster, ctl = self.cluster, self.controller
        if ctl is None:
            return None
        snaps = cluster.snapshots()
        ests = [s.load.estimator for s in snaps if s.healthy and s.load.estimator is not None]
        if ests:  # pooled over the instances: one instance's online estimate swings by a third
            taus = ests[0].taus
            same = [e.rates for e in ests if e.taus == taus]
            ctl.set_tokens_per_step(taus, [sum(r) / len(same) for r in zip(*same)])
            fill = pooled_fill((e.last_block_fill, e.fill_count) for e in ests)
            if fill is not None:
                ctl.set_last_block_fill(fill)
        slack = [d - now for s in snaps for d in s.load.deadlines]
        current = tuple(i.tp_degree for i in cluster.infos if cluster.engine(i.name).healthy) or \
            tuple(i.tp_degree for i in cluster.infos)
        since = ctl.feedback_since(now)
        got = realised((s.load.outcomes for s in snaps), (d for s in snaps for d in s.load.deadlines), since, now)
        lat_since = ctl.latency_feedback_since(now, slack)
        lat = None if lat_since is None else realised_latency((s.load.outcomes for s in snaps), lat_since)
        decision = ctl.decide(now, current, in_flight_slack=slack, compiled=cluster.compiled_placements(),
                              realised=got, realised_latency=lat)
        if decision.switch:
            log.info("controller: %s", decision)
            report = cluster.reconfigure(decision.chosen, reason="controller")
            ctl.switched(self.clock())
            log.info("controller: reconfigured %s", report)
            return decision
        for m in self._plan_migrations(now, snaps):
            if cluster.migrate(m.request_id, m.target, "at risk"):
                self.migrations.append((now, m))
                del self.migrations[:-64]
                log.info("controller: moved %s from %s to %s (%s)", m.request_id, m.source, m.target, m.reason)
        return decision

    def _plan_migrations(self, now: float, snaps) -> list[Migration]:
        spare = {s.name: s for s in snaps if s.healthy and not s.load.waiting_left and not s.pending
                 and len(s.load.running_left) < s.load.num_slots and s.load.estimator is not None}
        if not spare:
            return []
        at_risk = {}
        for s in snaps:
            if not s.load.at_risk:
                continue
            views = []
            for v in s.load.at_risk:
                best = min(((name, t.load.estimator.own_time(v, len(t.load.running_left) + 1, v.tau_min))
                            for name, t in spare.items() if name != s.name), key=lambda x: x[1], default=None)
                if best is not None:
                    views.append((AtRisk(v.id, v.deadline, best[1], v.running, v.moves, None), best[0]))

            if views:
                at_risk[s.name] = views
        return self.controller.plan_migrations(now, at_risk)
