"""Layouts in plain numbers: the mesh-spec grammar, where each instance's devices go, its name, and
what a switch between two layouts moves.

A mesh spec says how many instances of which tensor-parallel (TP) degree: terms joined by "+"; a
term is either "T" (one instance of TP degree T) or "NxT" (N instances of TP degree T). So "2x4" is
two TP-4 instances, "8" and "1x8" are one TP-8 instance, "8x1" is eight unsharded replicas and
"4+2+1+1" mixes degrees.

Everything here is pure Python over TP degrees and device ids, so the controller and the simulator
reason about layouts exactly as `mesh.Layout` builds them, without JAX.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Sequence

# the one axis of every instance's device mesh; the sharding table and the kernels split over it
MODEL_AXIS = "model"

_TERM = re.compile(r"^(?:(\d+)x)?(\d+)$")


class MeshSpecError(ValueError):
    """A mesh spec that cannot be built: the message says what is wrong and how to fix it."""


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True, slots=True)
class MeshSpec:
    """TP degree of every instance, in the order written (e.g. "4+2+1+1" -> (4, 2, 1, 1))."""

    tp_degrees: tuple[int, ...]

    def __post_init__(self):
        if not self.tp_degrees:
            raise MeshSpecError("a mesh spec needs at least one instance")
        for tp in self.tp_degrees:
            if not isinstance(tp, int) or not is_power_of_two(tp):
                raise MeshSpecError(f"TP degree {tp!r} is not a power of two (use 1, 2, 4, 8, ...)")

    @classmethod
    def parse(cls, text: str) -> "MeshSpec":
        """Parse "2x4", "8", "1x8", "8x1", "4+2+1+1" or mixes such as "2x2+4"."""
        if not isinstance(text, str) or not text.strip():
            raise MeshSpecError("empty mesh spec; write e.g. '2x4' (2 instances of TP 4) or '4+2+1+1'")
        degrees: list[int] = []
        for term in text.replace(" ", "").lower().split("+"):
            m = _TERM.match(term)
            if not m:
                raise MeshSpecError(f"cannot parse {term!r} in mesh spec {text!r}: each '+'-separated term is "
                                    "'T' (one TP-T instance) or 'NxT' (N instances of TP T), e.g. '2x4' or '4+2+1+1'")
            count, tp = int(m.group(1) or 1), int(m.group(2))
            if count == 0:
                raise MeshSpecError(f"{term!r} in mesh spec {text!r} asks for zero instances")
            if not is_power_of_two(tp):
                raise MeshSpecError(f"TP degree {tp} in mesh spec {text!r} is not a power of two (use 1, 2, 4, 8, ...)")
            degrees.extend([tp] * count)
        return cls(tuple(degrees))

    @property
    def num_devices(self) -> int:
        return sum(self.tp_degrees)

    @property
    def num_instances(self) -> int:
        return len(self.tp_degrees)

    def __str__(self) -> str:
        """Canonical text: "NxT" when all degrees are equal, else degrees joined by "+"."""
        if len(set(self.tp_degrees)) == 1:
            return f"{len(self.tp_degrees)}x{self.tp_degrees[0]}"
        return "+".join(str(tp) for tp in self.tp_degrees)

    def check_device_count(self, available: int, *, allow_unused: bool = False) -> None:
        """Raise MeshSpecError unless the spec uses exactly `available` devices (or fewer, if allowed)."""
        if self.num_devices > available:
            raise MeshSpecError(f"mesh spec {self} needs {self.num_devices} devices but only {available} exist")
        if self.num_devices < available and not allow_unused:
            raise MeshSpecError(f"device count mismatch: mesh spec {self} uses {self.num_devices} devices but "
                                f"{available} are available; write a spec that covers all {available}")


# --- layouts as tuples of TP degrees, widest first (the controller's and simulator's currency) ---
def parse_layout(text: str) -> tuple[int, ...]:
    """TP degrees of a mesh spec ("2x4", "8", "4+2+1+1"), widest first; MeshSpecError if malformed."""
    return tuple(sorted(MeshSpec.parse(text).tp_degrees, reverse=True))


def layout_text(layout: Sequence[int]) -> str:
    """The canonical mesh-spec text of a layout ("2x4", "4+2+1+1")."""
    return str(MeshSpec(tuple(sorted(layout, reverse=True))))


def binary_partitions(n: int, parts: Sequence[int]) -> list[tuple[int, ...]]:
    """Every layout of n devices from the given TP degrees: each way to write n as a sum of the
    parts (descending tuples, each once)."""
    parts = sorted(set(parts), reverse=True)
    out: list[tuple[int, ...]] = []

    def rec(left: int, start: int, acc: list[int]) -> None:
        if left == 0:
            out.append(tuple(acc))
            return
        for i in range(start, len(parts)):
            p = parts[i]
            if p <= left:
                acc.append(p)
                rec(left - p, i, acc)
                acc.pop()
    rec(n, 0, [])
    return out


# --- placement: the one rule `mesh.Layout.build` and the controller both follow ---
def place(tp_degrees: Sequence[int], free_ids: Mapping[int, Sequence[int]]) -> list[tuple[int, ...]]:
    """Device ids of each instance (in the order of `tp_degrees`), given each process's free ids.

    Widest instances first (equal widths in the order given), each into the first process (in the
    mapping's order) with enough free devices, on that process's lowest free ids. With power-of-two
    degrees this keeps every TP group contiguous and aligned to its size; a group never spans
    processes, since they share only the slow network.
    """
    free = {p: sorted(ids) for p, ids in free_ids.items()}
    chosen: dict[int, tuple[int, ...]] = {}
    for index in sorted(range(len(tp_degrees)), key=lambda k: -tp_degrees[k]):
        tp = tp_degrees[index]
        process = next((p for p, left in free.items() if len(left) >= tp), None)
        if process is None:
            have = {p: len(left) for p, left in free.items()}
            raise MeshSpecError(f"cannot place a TP-{tp} instance of {MeshSpec(tuple(tp_degrees))} inside one process: "
                                f"free local devices per process are {have}; TP groups may not span processes")
        chosen[index], free[process] = tuple(free[process][:tp]), free[process][tp:]
    return [chosen[k] for k in range(len(tp_degrees))]


def placements(layout: Sequence[int]) -> list[tuple[int, int]]:
    """(TP degree, first device) of each instance of a layout over one process's devices 0..n-1,
    widest first, as `place` assigns them."""
    widest_first = sorted(layout, reverse=True)
    ids = place(widest_first, {0: range(sum(widest_first))})
    return [(tp, group[0]) for tp, group in zip(widest_first, ids)]


def every_placement(degrees, num_devices: int) -> frozenset[tuple[int, int]]:
    """(TP degree, first device) of every aligned group of each degree over devices 0..n-1: where
    `place` can put an instance of that degree."""
    return frozenset((tp, first) for tp in set(degrees) for first in range(0, num_devices - tp + 1, tp))


def instance_name(device_ids: Sequence[int]) -> str:
    """What an instance is: "tp4@0-3" is TP 4 on devices 0-3, "tp1@6" one device. An instance
    present in two layouts has the same name in both."""
    ids = tuple(device_ids)
    return f"tp{len(ids)}@{ids[0]}" if len(ids) == 1 else f"tp{len(ids)}@{ids[0]}-{ids[-1]}"


# --- what a switch moves ---
def received_per_device(old: Sequence[int], new: Sequence[int]) -> list[float]:
    """Share of one model copy each device of `new` must receive, in placement order: it needs its
    1/TP shard and keeps the part of it it already holds under `old`."""
    old_of = {d: (tp, d - first) for tp, first in placements(old) for d in range(first, first + tp)}
    out = []
    for tp, first in placements(new):
        for d in range(first, first + tp):
            lo, hi = (d - first) / tp, (d - first + 1) / tp
            have = 0.0
            if d in old_of:
                o_tp, o_k = old_of[d]
                have = max(0.0, min(hi, (o_k + 1) / o_tp) - max(lo, o_k / o_tp))
            out.append(hi - lo - have)
    return out


def moved_fraction(old: Sequence[int], new: Sequence[int]) -> float:
    """Model copies that must arrive on devices to switch from `old` to `new` (summed over devices)."""
    return sum(received_per_device(old, new), 0.0)


def is_schedule(layout: str) -> bool:
    """A simulator layout that is a schedule (`parse_schedule`), not one mesh spec."""
    return layout.startswith("schedule:")


def parse_schedule(text: str) -> list[tuple[float, str]]:
    """`schedule:1x8@0,8x1@300,...` -> [(0.0, "1x8"), (300.0, "8x1"), ...]: the layouts a run is
    switched to at the given seconds, whatever the load (an oracle to measure what switching at
    the right moments is worth). The first entry is at 0; times increase; ValueError otherwise."""
    form = "a schedule is schedule:LAYOUT@SECONDS,... starting at 0, e.g. schedule:1x8@0,8x1@300"
    body = text.removeprefix("schedule:")
    out: list[tuple[float, str]] = []
    for item in filter(None, body.split(",")):
        spec, sep, when = item.partition("@")
        try:
            t = float(when)
        except ValueError:
            raise ValueError(f"bad schedule entry {item!r}: {form}") from None
        if not sep or not spec or t < 0 or (out and t <= out[-1][0]):
            raise ValueError(f"bad schedule entry {item!r}: {form}")
        out.append((t, layout_text(parse_layout(spec))))
    if not out or out[0][0] != 0:
        raise ValueError(f"bad schedule {text!r}: {form}")
    return out
