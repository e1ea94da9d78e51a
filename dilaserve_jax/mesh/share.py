"""A share of the machine: which devices serve, and what their arrays hold.

A server that runs beside a training job gets a subset of the visible devices (`--devices 4-7`)
and a per-device memory budget for its decode slots (`--kv-memory-gb`; how many slots fit is
config arithmetic, `models.memory`). `bytes_per_device` reads back what placed arrays hold.
"""
from __future__ import annotations

import re
from typing import Iterable, Sequence

import jax

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_device_ids(text: str) -> tuple[int, ...]:
    """"4-7" -> (4, 5, 6, 7); "4,5,6,7", "0-1,6-7" and mixes also work. Ids keep the order written."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("empty device list; write e.g. '4-7' or '4,5,6,7'")
    ids: list[int] = []
    for term in text.replace(" ", "").split(","):
        m = _RANGE.match(term)
        if not m:
            raise ValueError(f"cannot parse {term!r} in device list {text!r}: each ','-separated term is an id "
                             "('5') or an inclusive range ('4-7')")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ValueError(f"device range {term!r} runs backwards; write {hi}-{lo}")
        ids.extend(range(lo, hi + 1))
    if len(set(ids)) != len(ids):
        raise ValueError(f"device list {text!r} names a device twice")
    return tuple(ids)


def select_devices(ids: Iterable[int], available: Sequence | None = None) -> list:
    """The devices with these ids, in that order; an error names any id that is not visible."""
    available = list(jax.devices() if available is None else available)
    by_id = {d.id: d for d in available}
    ids = list(ids)
    missing = [i for i in ids if i not in by_id]
    if missing:
        raise ValueError(f"device id(s) {missing} are not visible: this process sees {len(available)} "
                         f"{available[0].platform if available else ''} device(s), ids {sorted(by_id)}")
    return [by_id[i] for i in ids]


def bytes_per_device(tree) -> dict[int, int]:
    """{device id: bytes of `tree`'s array shards held there} (weights or decode state)."""
    held: dict[int, int] = {}
    for leaf in jax.tree_util.tree_leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device.id] = held.get(shard.device.id, 0) + shard.data.nbytes
    return held


def share_layout(mesh: str, device_ids: Sequence[int] | None = None, *, allow_unused: bool = False):
    """The serving layout over every visible device, or over just `device_ids` (a device share)."""
    from dilaserve_jax.core.layouts import MeshSpec, MeshSpecError
    from dilaserve_jax.mesh.layout import Layout

    if device_ids is None:
        return Layout.build(mesh, allow_unused=allow_unused)
    devices = select_devices(device_ids)
    spec = MeshSpec.parse(mesh)
    if spec.num_devices > len(devices) or (spec.num_devices < len(devices) and not allow_unused):
        raise MeshSpecError(f"mesh {spec} uses {spec.num_devices} device(s) but the device share {list(device_ids)} "
                            f"has {len(devices)}; give a mesh of {len(devices)} devices or a share of "
                            f"{spec.num_devices}")
    return Layout.build(spec, devices=devices, allow_unused=allow_unused)
