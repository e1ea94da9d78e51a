"""A share of the machine: which devices serve, and how much of their memory the decode slots take.

A server that runs beside a training job gets a subset of the visible devices (`--devices 4-7`)
and a per-device memory budget for its decode slots (`--kv-memory-gb`). Per device, a serving
instance holds its shard of the weights plus, for every slot, its shard of the K/V cache (split
over kv heads, or whole when the instance replicates them; see mesh/sharding.py) and a
replicated canvas row with a few per-slot scalars.
"""
from __future__ import annotations

import re
from typing import Iterable, Sequence

import jax

from dilaserve_jax.decoding.state import SLOT_SCALAR_BYTES, kv_bytes_per_slot
from dilaserve_jax.mesh.sharding import kv_heads_replicated
from dilaserve_jax.models.config import ModelConfig

GIB = 2**30
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


def device_bytes_per_slot(cfg: ModelConfig, tp: int, length: int, with_cache: bool = True) -> int:
    """Device bytes one slot of canvas `length` takes on each device of a TP-`tp` instance."""
    kv = kv_bytes_per_slot(cfg, length) if with_cache else 0
    if kv and not kv_heads_replicated(cfg.n_kv_heads, tp):
        kv //= tp
    return kv + 4 * length + SLOT_SCALAR_BYTES  # + the replicated canvas row and per-slot scalars


def slots_for_device_budget(cfg: ModelConfig, tp: int, length: int, budget_bytes: int,
                            with_cache: bool = True) -> int:
    """How many slots fit in `budget_bytes` on each device of a TP-`tp` instance (0 if not one)."""
    if budget_bytes < 0:
        raise ValueError(f"budget must be non-negative, got {budget_bytes}")
    return int(budget_bytes // device_bytes_per_slot(cfg, tp, length, with_cache))


def slots_within(cfg: ModelConfig, tp: int, length: int, budget_bytes: int, cap: int, with_cache: bool = True) -> int:
    """Slots of a TP-`tp` instance under a per-device budget, at most `cap`; an error when none fits."""
    fit = slots_for_device_budget(cfg, tp, length, budget_bytes, with_cache)
    if fit < 1:
        need = device_bytes_per_slot(cfg, tp, length, with_cache)
        raise ValueError(f"a KV budget of {budget_bytes / GIB:.4g} GiB per device holds no slot: one slot of a "
                         f"{length}-token canvas needs {need / 2**20:.3f} MiB on each device of a TP-{tp} instance "
                         f"of {cfg.name}")
    return min(fit, cap)


def bytes_per_device(tree) -> dict[int, int]:
    """{device id: bytes of `tree`'s array shards held there} (weights or decode state)."""
    held: dict[int, int] = {}
    for leaf in jax.tree_util.tree_leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device.id] = held.get(shard.device.id, 0) + shard.data.nbytes
    return held


def share_layout(mesh: str, device_ids: Sequence[int] | None = None, *, allow_unused: bool = False):
    """The serving layout over every visible device, or over just `device_ids` (a device share)."""
    from dilaserve_jax.mesh.layout import Layout
    from dilaserve_jax.mesh.spec import MeshSpec, MeshSpecError

    if device_ids is None:
        return Layout.build(mesh, allow_unused=allow_unused)
    devices = select_devices(device_ids)
    spec = MeshSpec.parse(mesh)
    if spec.num_devices > len(devices) or (spec.num_devices < len(devices) and not allow_unused):
        raise MeshSpecError(f"mesh {spec} uses {spec.num_devices} device(s) but the device share {list(device_ids)} "
                            f"has {len(devices)}; give a mesh of {len(devices)} devices or a share of "
                            f"{spec.num_devices}")
    return Layout.build(spec, devices=devices, allow_unused=allow_unused)
