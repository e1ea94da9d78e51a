"""Arrival pressure: is an instance losing deadlines to load? (pure Python; no JAX)

The threshold controller asks each plan: of the requests it planned over the last `window_s`, were
at least `share` at risk at some plan? Then the deadlines in hand are not the whole story, and
every request asks the budget for its fixed floor (see `threshold.py`)."""
from __future__ import annotations

from collections import deque
from typing import Iterable


class PressureWindow:
    def __init__(self, window_s: float, share: float | None, min_requests: int = 8) -> None:
        self.window_s, self.share, self.min_requests = window_s, share, min_requests
        self._arrived: deque[float] = deque()  # when each request was first planned, oldest first
        self._seen: set[str] = set()  # ids whose arrival is counted
        self._stressed: deque[tuple[float, str]] = deque()  # (when, id) found at risk, oldest first
        self._stressed_ids: set[str] = set()

    def observe(self, planned: Iterable[str], at_risk: Iterable[str], now: float) -> bool:
        """Count this plan's requests and those at risk; whether the instance is under pressure."""
        for rid in planned:
            if rid not in self._seen:
                self._seen.add(rid)
                self._arrived.append(now)
        for rid in at_risk:
            if rid not in self._stressed_ids:
                self._stressed_ids.add(rid)
                self._stressed.append((now, rid))
        while self._arrived and self._arrived[0] < now - self.window_s:
            self._arrived.popleft()
        while self._stressed and self._stressed[0][0] < now - self.window_s:
            self._stressed_ids.discard(self._stressed.popleft()[1])
        if self.share is None or len(self._arrived) < self.min_requests:
            return False
        return len(self._stressed) >= self.share * len(self._arrived)

    def forget(self, rid: str) -> None:
        """The request left (one that comes back is counted again)."""
        self._seen.discard(rid)
