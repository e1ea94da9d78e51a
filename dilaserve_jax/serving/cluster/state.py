"""What a cluster reports about itself: one frozen, typed snapshot (`Cluster.state()`).

GetClusterState, the Prometheus collector and the benchmarks read it; the simulator's cluster
reports the same type. Every collection in it is the state's own copy.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dilaserve_jax.serving.cluster.builder import InstanceInfo
from dilaserve_jax.serving.policy.quality import QualitySnapshot
from dilaserve_jax.serving.policy.snapshots import EngineSnapshot


class _ByName:
    """Fields may also be read by name (`state["layout"]`), as plain mappings of state are."""

    __slots__ = ()

    def __getitem__(self, key: str) -> Any:
        if key not in self.__dataclass_fields__:  # type: ignore[attr-defined]
            raise KeyError(key)
        return getattr(self, key)


@dataclass(frozen=True, slots=True)
class InstanceState(_ByName):
    name: str
    tp_degree: int
    device_ids: tuple[int, ...]
    slots: int
    running: int
    waiting: int  # queued, plus submitted and not yet seen by its scheduler
    steps_done: int
    state: str  # "created", "running", "stopped" or "failed"
    error: str  # the fault of a failed instance, else ""
    quality: QualitySnapshot | None  # accuracy-budget accounting; None without an accuracy model
    host: str = ""  # the host it runs on ("" in a one-process server)

    @property
    def up(self) -> bool:
        return self.state in ("running", "created")

    @classmethod
    def of(cls, info: InstanceInfo, snap: EngineSnapshot) -> "InstanceState":
        load = snap.load
        return cls(info.name, info.tp_degree, tuple(info.device_ids), load.num_slots, len(load.running_left),
                   len(load.waiting_left) + len(snap.pending), snap.steps, snap.state.name.lower(),
                   snap.error or "", load.quality, info.host)


@dataclass(frozen=True, slots=True)
class ControllerState(_ByName):
    mode: str  # "auto", "paused" or "manual"
    decisions: tuple[str, ...] = ()  # the latest, with their reasons, newest last
    recent_migrations: tuple[str, ...] = ()  # the latest requests it moved, newest last


NO_CONTROLLER = ControllerState("manual")


@dataclass(frozen=True, slots=True)
class CheckpointWatchState(_ByName):
    directory: str
    last_step: int  # newest step swapped in (or served from the start); -1 before any
    reloads: int
    skipped: int  # finalized steps that could not be read, never retried
    last_error: str
    last_reload_seconds: float
    polls: int


@dataclass(frozen=True, slots=True)
class ClusterState(_ByName):
    layout: str
    policy: str
    model: str
    family: str
    instances: tuple[InstanceState, ...]
    failures: dict[str, str] = field(default_factory=dict)  # instance -> the fault that failed it
    migrations: dict[str, int] = field(default_factory=dict)  # reason -> requests moved
    reloads: int = 0
    in_flight: int = 0
    weight_updates: dict[str, int] = field(default_factory=dict)  # origin ("reload", "push", "watch") -> swaps
    controller: ControllerState = NO_CONTROLLER
    reconfigurations: tuple[str, ...] = ()  # the latest layout switches, newest last
    checkpoint_watch: CheckpointWatchState | None = None  # while a watcher follows a training directory

    def as_dict(self) -> dict:
        """Plain dicts and lists all the way down (JSON-ready)."""
        return _plain(self)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
