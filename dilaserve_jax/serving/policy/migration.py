"""Which at-risk requests move to another instance at the next step boundary (pure; no JAX)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from dilaserve_jax.serving.policy.controller_config import AtRisk, ControllerConfig, Migration


@dataclass
class MigrationPlanner:
    """Plans moves for requests that cannot meet their deadline where they run; remembers when each
    request last moved, so that none moves again within `migration_cooldown_s`."""
    cfg: ControllerConfig
    _last_move: dict[str, float] = field(default_factory=dict)

    def plan(self, now: float, at_risk: Mapping[str, Sequence[tuple[AtRisk, str]]]) -> list[Migration]:
        """Moves for at-risk requests: `at_risk` maps each source instance to its at-risk requests,
        each with the instance with spare capacity (a free slot, an empty queue) where it would
        finish soonest and `remaining_s` its predicted time there. A request moves if it would meet
        its deadline there; one request per target per round, each request at most once per
        cooldown, at most `max_migrations` per round."""
        self._last_move = {k: t for k, t in self._last_move.items() if now - t < self.cfg.migration_cooldown_s}
        out: list[Migration] = []
        used: set[str] = set()
        for src, items in at_risk.items():
            for r, target in sorted(items, key=lambda x: x[0].deadline):
                if len(out) >= self.cfg.max_migrations:
                    return out
                if target == src or target in used:
                    continue
                last = self._last_move.get(r.request_id, r.last_move)
                if last is not None and now - last < self.cfg.migration_cooldown_s:
                    continue
                if now + r.remaining_s > r.deadline:
                    continue
                out.append(Migration(r.request_id, src, target, "at risk"))
                self._last_move[r.request_id] = now
                used.add(target)
        return out
