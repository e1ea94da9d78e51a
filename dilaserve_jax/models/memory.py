"""Device bytes of a model's decode slots: config arithmetic, no arrays.

A slot holds its canvas row [L] int32, a few per-slot scalars, and (unless the cache mode is none)
the K/V cache of every layer [L, kv_heads, head_dim] for K and for V, in the activation dtype
(the fields of `decoding.state.DecodeState`). On a TP instance the cache is split over kv heads,
or whole on every device when there are fewer kv heads than TP (`core.heads`); the canvas row and
the scalars are replicated. The decode state, device shares and the executor size slots with this.
"""
from __future__ import annotations

from dilaserve_jax.core.heads import kv_heads_replicated
from dilaserve_jax.models.config import ModelConfig

GIB = 2**30
SLOT_SCALAR_BYTES = 4 * 7  # prompt_len, answer_len, block_start, block_len, temperature, seed, steps


def kv_bytes_per_slot(cfg: ModelConfig, length: int) -> int:
    """K and V of every layer for one slot of canvas `length` (cache in the activation dtype)."""
    itemsize = 2 if cfg.dtype == "bfloat16" else 4
    return 2 * cfg.n_layers * length * cfg.n_kv_heads * cfg.head_dim * itemsize


def device_bytes_per_slot(cfg: ModelConfig, tp: int, length: int, with_cache: bool = True) -> int:
    """Device bytes one slot of canvas `length` takes on each device of a TP-`tp` instance."""
    kv = kv_bytes_per_slot(cfg, length) if with_cache else 0
    if kv and not kv_heads_replicated(cfg.n_kv_heads, tp):
        kv //= tp
    return kv + 4 * length + SLOT_SCALAR_BYTES


def bytes_per_slot(cfg: ModelConfig, length: int, with_cache: bool = True) -> int:
    """Device bytes of one slot on one device: K/V cache plus the canvas and the per-slot scalars."""
    return device_bytes_per_slot(cfg, 1, length, with_cache)


def slots_for_device_budget(cfg: ModelConfig, tp: int, length: int, budget_bytes: int,
                            with_cache: bool = True) -> int:
    """How many slots fit in `budget_bytes` on each device of a TP-`tp` instance (0 if not one)."""
    if budget_bytes < 0:
        raise ValueError(f"budget must be non-negative, got {budget_bytes}")
    return int(budget_bytes // device_bytes_per_slot(cfg, tp, length, with_cache))


def slots_for_budget(cfg: ModelConfig, length: int, budget_bytes: int, with_cache: bool = True) -> int:
    """How many slots of canvas `length` fit in `budget_bytes` on one device (0 if not even one)."""
    return slots_for_device_budget(cfg, 1, length, budget_bytes, with_cache)


def slots_within(cfg: ModelConfig, tp: int, length: int, budget_bytes: int, cap: int, with_cache: bool = True) -> int:
    """Slots of a TP-`tp` instance under a per-device budget, at most `cap`; an error when none fits."""
    fit = slots_for_device_budget(cfg, tp, length, budget_bytes, with_cache)
    if fit < 1:
        need = device_bytes_per_slot(cfg, tp, length, with_cache)
        raise ValueError(f"a KV budget of {budget_bytes / GIB:.4g} GiB per device holds no slot: one slot of a "
                         f"{length}-token canvas needs {need / 2**20:.3f} MiB on each device of a TP-{tp} instance "
                         f"of {cfg.name}")
    return min(fit, cap)
