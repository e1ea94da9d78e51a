"""Mesh specs against a model: can each TP degree of a spec shard this model's heads and MLP?

The grammar itself ("2x4", "4+2+1+1") is pure and lives in `core.layouts`, where the controller and
the simulator read it too; this module adds the checks that need a `ModelConfig`.
"""
from __future__ import annotations

from dilaserve_jax.core.heads import head_problems
from dilaserve_jax.core.layouts import MeshSpec, MeshSpecError, is_power_of_two
from dilaserve_jax.models.config import ModelConfig

__all__ = ["MeshSpec", "MeshSpecError", "check_model", "check_model_tp"]


def check_model(spec: MeshSpec, cfg: ModelConfig) -> None:
    """Raise MeshSpecError if some TP degree of `spec` cannot shard this model; see `check_model_tp`."""
    for tp in sorted(set(spec.tp_degrees)):
        check_model_tp(cfg, tp)


def check_model_tp(cfg: ModelConfig, tp: int) -> None:
    """Can a TP-`tp` instance shard `cfg`? Heads and MLP width must divide; kv heads are flexible
    (sharded when TP divides them, replicated when there are fewer than TP; `core.heads`)."""
    if not is_power_of_two(tp):
        raise MeshSpecError(f"TP degree {tp} is not a power of two")
    problems = head_problems(cfg.n_heads, cfg.n_kv_heads, tp)
    if cfg.mlp_hidden % tp:
        problems.append(f"TP {tp} does not divide the MLP width {cfg.mlp_hidden}")
    if problems:
        raise MeshSpecError(f"model {cfg.name!r} cannot run at TP {tp}: " + "; ".join(problems))
