"""The cluster as an administrative operation sees it: one operation at a time, explicit changes.

A reshape (serving/cluster/reshape.py) or a weight swap (serving/cluster/weights_swap.py) holds
the cluster exclusively for its whole run (`Administered.exclusive`) and changes it only through
the `ClusterAdmin` it is handed, whose calls take the cluster's own locks. Neither module imports
the cluster: both work over these two protocols, and the cluster calls them.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Callable, Protocol, Sequence

from dilaserve_jax.serving.cluster.builder import InstanceBuilder, InstanceInfo
from dilaserve_jax.serving.cluster.engine import Engine
from dilaserve_jax.serving.cluster.engine_types import Handoff


class ClusterBusy(RuntimeError):
    """Another administrative operation (reload, reconfiguration) is under way."""


class ClusterAdmin(Protocol):
    """What one administrative operation may read and change while it holds the cluster."""

    clock: Callable[[], float]

    @property
    def layout(self) -> str:
        """The layout being served."""

    @property
    def engines(self) -> list[Engine]:
        """The engines serving now (new requests go to them), in layout order."""

    @property
    def healthy_engines(self) -> list[Engine]:
        ...

    def adopt(self, engines: Sequence[Engine]) -> None:
        """Prepare engines built for the cluster: its failure handling and step hooks."""

    def retire(self, engines: Sequence[Engine]) -> None:
        """Take serving engines out of the serving set now (still reachable by name until `forget`);
        while no engine serves, new requests are held until `install`."""

    def install(self, engines: Sequence[Engine], infos: Sequence[InstanceInfo], layout: str) -> None:
        """Make `engines` the serving set in one step (serving engines left out of it retire), then
        place the requests held meanwhile."""

    def requeue(self, handoffs: Sequence[Handoff], reason: str, exclude: frozenset[str] = frozenset()) -> None:
        """Place requests taken off engines on the serving ones (their next step is a refresh)."""

    def forget(self, names: Sequence[str]) -> None:
        """Retired engines that are empty and stopped: no longer reachable by name."""

    def record_reconfiguration(self, report: object) -> None:
        """Keep a reconfiguration's report (the cluster state shows the latest)."""

    def weights_swapped(self, source: str, origin: str) -> None:
        """The engines now serve the weights of `source` (origin: "reload", "push", "watch")."""

    def emit(self, event: str, details: dict) -> None:
        """Tell the cluster's listeners (metrics, logs) what happened."""


class Administered(Protocol):
    """What the actuator modules use of the cluster itself."""

    builder: InstanceBuilder | None

    def exclusive(self, what: str, wait_s: float | None = None) -> AbstractContextManager[ClusterAdmin]:
        """Hold the cluster for one administrative operation (`what`, e.g. "reconfiguration"); waits
        up to `wait_s` for one under way (None: not at all), else raises ClusterBusy."""

    def instance_of(self, request_id: str) -> str | None:
        ...

    def engine(self, name: str) -> Engine:
        ...

    def requeue(self, handoffs: Sequence[Handoff], reason: str, exclude: frozenset[str] = frozenset(),
                prefer: str | None = None) -> None:
        ...
