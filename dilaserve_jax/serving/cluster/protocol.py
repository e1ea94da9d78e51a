"""The cluster contract: what the controller's actuator (`Autoscaler`) and the frontends use.

Two classes implement it: the threaded `Cluster` (serving/cluster/cluster.py) and the simulator's
`SimCluster` (sim/cluster.py), so the control round runs unchanged on either.
"""
from __future__ import annotations

from typing import Callable, Protocol, Sequence, runtime_checkable

from dilaserve_jax.serving.cluster.builder import InstanceInfo
from dilaserve_jax.serving.cluster.engine_types import ProgressFn, RequestHandle
from dilaserve_jax.serving.cluster.state import ClusterState
from dilaserve_jax.serving.policy.request import Request
from dilaserve_jax.serving.policy.snapshots import EngineSnapshot

ArrivalObserver = Callable[[Request, float], None]


class InstanceView(Protocol):
    """An instance as others see it: its name, health and published snapshot."""

    name: str

    @property
    def healthy(self) -> bool:
        ...

    def snapshot(self) -> EngineSnapshot:
        ...


@runtime_checkable
class ServingCluster(Protocol):
    ready: bool  # every instance is compiled and warm: requests may come
    layout: str  # canonical text of the layout being served ("2x4", "4+2+1+1")
    infos: Sequence[InstanceInfo]  # the serving instances, in layout order

    def snapshots(self) -> list[EngineSnapshot]:
        """Every serving instance's published snapshot, in layout order."""

    def engine(self, name: str) -> InstanceView:
        """A serving or retiring instance by name (KeyError if none)."""

    def instance_of(self, request_id: str) -> str | None:
        """Where a request in flight is now (None when it is not, or is held)."""

    def compiled_placements(self) -> frozenset[tuple[int, int]]:
        """(TP degree, first device) of every placement with executables (free to switch to)."""

    def add_arrival_observer(self, observer: ArrivalObserver) -> None:
        """`observer(request, now)` on every accepted submission (the controller's load estimate)."""

    def submit(self, request: Request, on_progress: ProgressFn | None = None,
               instance: str | None = None) -> RequestHandle:
        """Place a request (on `instance` while it is healthy, else where the router says)."""

    def abort(self, request_id: str) -> bool:
        """Cancel a request in flight (False if it is not)."""

    def reconfigure(self, spec: str, reason: str = "manual") -> object:
        """Switch to layout `spec` while serving; returns the switch's report."""

    def migrate(self, request_id: str, target: str, reason: str = "rebalance", timeout: float = 60.0) -> bool:
        """Move one request to instance `target` at its next step boundary (False if it is gone)."""

    def state(self) -> ClusterState:
        ...
