"""What a scheduler publishes of its load for the router and the cluster controller: each running
and waiting request's predicted time, the deadlines, the requests at risk, and the estimates a
peer needs to price a request that might move here. Kept apart from the scheduling itself: it
reads the scheduler's state and never changes it, and it holds the caches that keep publishing
cheap under a deep queue."""
from __future__ import annotations

from collections import OrderedDict

from dilaserve_jax.core.kinds import StepKind
from dilaserve_jax.serving.policy.request import Request
from dilaserve_jax.serving.policy.snapshots import LoadSnapshot, RequestEstimator, RequestView


class PublishedLoad:
    """Mixed into `Scheduler` (which provides cfg, latency, controller, decisions, running,
    waiting, requests, lat_scale, request_time, quality and _tau)."""

    def _init_published(self) -> None:
        self._priced: OrderedDict[str, float] = OrderedDict()  # waiting request -> its last published price
        self._views: dict[str, RequestView] = {}  # waiting requests' published views (made once each)

    def snapshot(self, now: float) -> LoadSnapshot:
        """The published load. Waiting requests beyond `reprice_per_round` are priced again a
        slice per round, oldest price first (approximation: a queued request's price lags the
        estimates by at most queue / reprice_per_round rounds); the requests' own state does not
        change while they wait, only the estimates and their planned τ do."""
        # (runs every iteration over the whole queue: comprehensions and plain comparisons)
        run, waiting = list(self.running.values()), self.waiting
        b = len(run) + len(waiting)
        b = self.cfg.num_slots if b > self.cfg.num_slots else b if b > 1 else 1
        price = self._price
        running = tuple([price(r, b) for r in run])
        at_risk = [RequestView.of(r) for r in run if r.at_risk]  # a running one's view changes every step
        views = self._views  # a waiting one's does not (dropped when it leaves the queue)
        at_risk += [views.get(r.id) or self._view(r) for r in waiting if r.at_risk]
        deadlines = tuple([r.deadline for r in run] + [r.deadline for r in waiting])
        return LoadSnapshot(now, self.cfg.num_slots, self.cfg.tp, running, self._waiting_prices(b),
                            self.estimator(), deadlines, tuple(at_risk), self.quality(), self.outcomes.published())

    def _view(self, r: Request) -> RequestView:
        v = self._views[r.id] = RequestView.of(r)
        return v

    def _left_queue(self, req_id: str) -> None:
        self._priced.pop(req_id, None)
        self._views.pop(req_id, None)

    def _price(self, r: Request, batch: int) -> float:
        # a request added since the last round has no decision yet: priced at its ceiling, as an
        # unplanned one is
        d = self.decisions.get(r.id)
        tau = d.tau if d else r.tau_max if self.cfg.adaptive else self._tau(r)
        return self.request_time(r, batch, tau)

    def _waiting_prices(self, batch: int) -> tuple[float, ...]:
        priced = self._priced  # maintained: only requests still waiting, the oldest price first
        if len(self.waiting) <= self.cfg.reprice_per_round:
            priced.clear()
            for r in self.waiting:
                priced[r.id] = self._price(r, batch)
            return tuple(priced.values())
        for _ in range(min(self.cfg.reprice_per_round, len(priced))):
            rid, _p = priced.popitem(last=False)
            r = self.requests.get(rid)
            if r is not None and r.slot is None:  # (every way out of the queue drops its price)
                priced[rid] = self._price(r, batch)
        out = [priced.get(r.id) for r in self.waiting]
        if None in out:  # new here
            for i, r in enumerate(self.waiting):
                if out[i] is None:
                    out[i] = priced[r.id] = self._price(r, batch)
        return tuple(out)

    def estimator(self) -> RequestEstimator:
        taus = tuple(sorted(set(self.controller.cfg.grid)))
        return RequestEstimator(self.latency, self.cfg.tp, self.lat_scale[StepKind.REFRESH],
                                self.lat_scale[StepKind.REUSE], taus,
                                tuple(self.controller.tps.rate(t) for t in taus), self.fill.mean, self.fill.count)
