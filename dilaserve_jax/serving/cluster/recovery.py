"""Rebuilding a failed instance on its own devices, so a fault costs a pause, not the capacity.

When an instance fails (its runner raised, its loop died), the cluster moves
its requests to the survivors (serving/cluster/cluster.py). Without more, the instance's devices
then stay idle until the next layout switch; and when it was the only instance, every request in
flight and every new one would fail. With recovery on, the cluster instead reshapes into the
layout it already has (serving/cluster/reshape.py): the failed instance is the one part that is
not kept, so it alone is rebuilt, from the weights still on its devices, and starts serving
again. While no instance is up the cluster holds requests, exactly as during a layout switch, and
places them once the rebuilt instance serves.

Limits, so that a fault that comes back does not rebuild forever: at most `max_rebuilds` rebuilds
of one instance within `window_s`; after that it stays failed. A rebuild that itself fails (the
devices lost their memory, the builder cannot build) releases the held requests, which then fail
as they would without recovery, naming the fault. An instance the watchdog failed is not
rebuilt: its hung device call still holds the devices. Only builders that say they can rebuild in place
(`rebuilds_in_place`) are asked; a builder over several hosts cannot (a killed host holds nothing).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Protocol

from dilaserve_jax.serving.cluster.admin import ClusterBusy
from dilaserve_jax.serving.cluster.engine_types import HungStep

log = logging.getLogger(__name__)


class Recoverable(Protocol):
    builder: object
    layout: str

    @property
    def stopping(self) -> bool: ...
    def reconfigure(self, spec: str, reason: str = "manual"): ...
    def release_held(self) -> None: ...


class Recovery:
    def __init__(self, cluster: Recoverable, enabled: bool = True, max_rebuilds: int = 3, window_s: float = 600.0,
                 retry_s: float = 0.2, clock: Callable[[], float] = time.monotonic) -> None:
        if max_rebuilds < 0 or window_s <= 0 or retry_s <= 0:
            raise ValueError("max_rebuilds >= 0, window_s and retry_s > 0")
        self.cluster, self.enabled = cluster, enabled
        self.max_rebuilds, self.window_s, self.retry_s, self.clock = max_rebuilds, window_s, retry_s, clock
        self._rebuilds: dict[str, deque[float]] = {}  # instance -> when its recent rebuilds started
        self._lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self.done: list[tuple[str, str]] = []  # (instance, outcome) per attempt, newest last

    def wanted(self, name: str, error: BaseException) -> bool:
        """Whether `name`, failed with `error`, gets a rebuild (counts it when so)."""
        builder = self.cluster.builder
        if not self.enabled or self.cluster.stopping or not getattr(builder, "rebuilds_in_place", False):
            return False
        if isinstance(error, HungStep):  # the hung device call still holds the devices
            return False
        now = self.clock()
        with self._lock:
            recent = self._rebuilds.setdefault(name, deque())
            while recent and now - recent[0] > self.window_s:
                recent.popleft()
            if len(recent) >= self.max_rebuilds:
                log.error("instance %s failed again: not rebuilt (%d rebuilds in the last %.0f s)", name,
                          len(recent), self.window_s)
                return False
            recent.append(now)
        return True

    def start(self, name: str, held: bool) -> None:
        """Rebuild `name` in the background; `held`: the cluster holds arrivals for it (none is left)."""
        t = threading.Thread(target=self._rebuild, args=(name, held), name=f"recover-{name}", daemon=True)
        with self._lock:
            self.threads = [x for x in self.threads if x.is_alive()] + [t]
        t.start()

    def _rebuild(self, name: str, held: bool) -> None:
        c = self.cluster
        while not c.stopping:
            try:
                report = c.reconfigure(c.layout, reason=f"recovery of {name}")
            except ClusterBusy:  # a reload or a layout switch is under way: rebuild after it
                time.sleep(self.retry_s)
                continue
            except Exception as err:  # noqa: BLE001 - it stays failed; the held requests fail as before
                log.error("could not rebuild instance %s: %s: %s", name, type(err).__name__, err)
                self._record(name, f"failed: {type(err).__name__}: {err}")
                break
            log.info("instance %s rebuilt on its devices in %.2f s (%s)", name, report.total_s, report)
            self._record(name, "rebuilt" if name in report.added else "gone from the layout")
            break
        if held:  # after a rebuild this places nothing (the switch placed what it held); else they fail
            c.release_held()

    def _record(self, name: str, outcome: str) -> None:
        with self._lock:
            self.done.append((name, outcome))
            del self.done[:-64]

    def join(self, timeout: float | None = None) -> None:
        """Wait for the rebuilds under way (the cluster's stop; tests)."""
        for t in list(self.threads):
            t.join(timeout)
