"""The leader's connection to one host's worker: operations out, reports in, death noticed.

Two threads per host. The sender sends the operations queued since its last call as one ordered
batch and waits for it to be applied, so a batch never overtakes the one before (the worker
serves several calls at once). The poller long-polls the worker's reports and hands each to the
instance it names, in the order the worker made them (the host's step counts go to the leader's
step totals), then the instances' snapshots. Either call
failing with `HostLost` (the worker process died: Ray raises `RayActorError` on the call in
flight) fails every instance of the host, which re-queues their requests on the survivors.

The transport is two blocking calls, `apply(ops)` and `poll(wait_s)`: over Ray (`RayTransport`),
or straight into an in-process `HostWorker` (`LocalTransport`, for tests of the leader side).
"""
from __future__ import annotations

import logging
import pickle
import threading
from typing import Callable, Protocol, Sequence

from dilaserve_jax.serving.cluster.hosts.remote_engine import HostLost, RemoteEngine
from dilaserve_jax.serving.cluster.hosts.step_tally import HostStepTotals

log = logging.getLogger(__name__)


class Transport(Protocol):
    def apply(self, ops: Sequence[tuple]) -> int:
        ...

    def poll(self, wait_s: float) -> tuple[list[tuple], dict]:
        ...


class LocalTransport:
    """Calls an in-process HostWorker, pickling what crosses as Ray would (each side owns its copy
    of a request); `lose()` makes every later call raise HostLost."""

    def __init__(self, worker) -> None:
        self.worker, self.lost = worker, False

    def apply(self, ops):
        self._check()
        return self.worker.apply(pickle.loads(pickle.dumps(list(ops))))

    def poll(self, wait_s):
        self._check()
        out = pickle.loads(pickle.dumps(self.worker.poll(wait_s)))
        self._check()
        return out

    def lose(self) -> None:
        self.lost = True

    def _check(self) -> None:
        if self.lost:
            raise HostLost("worker lost (test)")


class RayTransport:
    """The calls of a HostWorker Ray actor; a dead actor raises HostLost."""

    def __init__(self, actor) -> None:
        self.actor = actor

    def apply(self, ops):
        return self._get(self.actor.apply.remote(list(ops)))

    def poll(self, wait_s):
        return self._get(self.actor.poll.remote(wait_s))

    @staticmethod
    def _get(ref):
        import ray

        try:
            return ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.RaySystemError) as err:
            raise HostLost(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from err


class HostLink:
    def __init__(self, host: str, transport: Transport, poll_wait_s: float = 0.05,
                 on_lost: Callable[["HostLink", BaseException], None] | None = None,
                 step_totals: HostStepTotals | None = None) -> None:
        self.host, self.transport, self.poll_wait_s, self.on_lost = host, transport, poll_wait_s, on_lost
        self.step_totals = step_totals  # where the host's step counts go (None: dropped)
        self.engines: dict[str, RemoteEngine] = {}  # by the name on the host
        self.lost: BaseException | None = None
        self._cv = threading.Condition()
        self._outbox: list[tuple] = []
        self._seq = 0  # operations queued so far
        self._acked = 0  # operations the host has applied
        self._stop = False
        self._threads: list[threading.Thread] = []
        self.calls = {"apply": 0, "poll": 0, "ops": 0, "reports": 0, "step_counts": 0}  # what crossed (benchmark)

    def attach(self, engines: Sequence[RemoteEngine]) -> None:
        self.engines = {e.local_name: e for e in engines}

    def start(self) -> "HostLink":
        for target, what in ((self._send_loop, "send"), (self._poll_loop, "poll")):
            t = threading.Thread(target=target, name=f"host-{what}-{self.host}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout)

    @property
    def alive(self) -> bool:
        return self.lost is None and not self._stop

    def send(self, op: tuple) -> int:
        """Queue one operation; returns its sequence number. Once the host is lost operations are
        dropped: its instances' failure moves the requests they carried."""
        with self._cv:
            self._seq += 1
            if self.lost is None:
                self._outbox.append(op)
                self._cv.notify_all()
            return self._seq

    def _send_loop(self) -> None:
        while True:
            with self._cv:
                while not self._outbox and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                batch, self._outbox, last = self._outbox, [], self._seq
            self.calls["apply"] += 1
            self.calls["ops"] += len(batch)
            try:
                self.transport.apply(batch)
            except HostLost as err:
                self._lose(err)
                return
            except Exception as err:  # noqa: BLE001 - a batch the host refused: treat the host as broken
                log.exception("host %s refused a batch of %d operation(s)", self.host, len(batch))
                self._lose(HostLost(f"host {self.host} refused operations: {err}"))
                return
            with self._cv:
                self._acked = last

    def _poll_loop(self) -> None:
        while True:
            with self._cv:
                if self._stop:
                    return
                acked = self._acked
            try:
                reports, snapshots = self.transport.poll(self.poll_wait_s)
            except HostLost as err:
                self._lose(err)
                return
            self.calls["poll"] += 1
            for report in reports:
                if report[0] == "steps":
                    self.calls["step_counts"] += 1
                    if self.step_totals is not None:
                        self.step_totals.add(self.host, report[2])
                    continue
                self.calls["reports"] += 1
                try:
                    self.engines[report[1]].reported(report)
                except Exception:  # noqa: BLE001 - one bad report must not stop the others
                    log.exception("host %s: handling a %r report failed", self.host, report[0])
            for name, snap in snapshots.items():
                if name in self.engines:
                    self.engines[name].host_snapshot(snap, acked)

    def _lose(self, err: BaseException) -> None:
        with self._cv:
            if self.lost is not None or self._stop:
                return
            self.lost = err
            self._outbox.clear()
            self._cv.notify_all()
        log.error("host %s lost (%s): failing its %d instance(s)", self.host, err, len(self.engines))
        for e in self.engines.values():
            e.fail(err)
        if self.on_lost is not None:
            self.on_lost(self, err)
