"""Mesh specs: how many instances of which tensor-parallel (TP) degree, e.g. "2x4" or "4+2+1+1".

Grammar: terms joined by "+"; a term is either "T" (one instance of TP degree T) or "NxT"
(N instances of TP degree T). So "2x4" is two TP-4 instances, "8" and "1x8" are one TP-8
instance, "8x1" is eight unsharded replicas and "4+2+1+1" mixes degrees.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from dilaserve_jax.models.config import ModelConfig

_TERM = re.compile(r"^(?:(\d+)x)?(\d+)$")


class MeshSpecError(ValueError):
    """A mesh spec that cannot be built: the message says what is wrong and how to fix it."""


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True, slots=True)
class MeshSpec:
    """TP degree of every instance, in the order written (e.g. "4+2+1+1" -> (4, 2, 1, 1))."""

    tp_degrees: tuple[int, ...]

    def __post_init__(self):
        if not self.tp_degrees:
            raise MeshSpecError("a mesh spec needs at least one instance")
        for tp in self.tp_degrees:
            if not isinstance(tp, int) or not _is_power_of_two(tp):
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
            if not _is_power_of_two(tp):
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

    def check_model(self, cfg: ModelConfig) -> None:
        """Raise MeshSpecError if some TP degree cannot shard this model; see `check_model_tp`."""
        for tp in sorted(set(self.tp_degrees)):
            check_model_tp(cfg, tp)


def check_model_tp(cfg: ModelConfig, tp: int) -> None:
    """Can a TP-`tp` instance shard `cfg`? Heads and MLP width must divide; kv heads are flexible.

    kv heads: sharded when tp divides n_kv_heads; replicated on every device of the instance when
    n_kv_heads < tp (whatever the ratio, since the whole K/V projection and cache are copied);
    an error when n_kv_heads >= tp but tp does not divide it (sharding would split a kv head).
    """
    if not _is_power_of_two(tp):
        raise MeshSpecError(f"TP degree {tp} is not a power of two")
    problems = head_problems(cfg.n_heads, cfg.n_kv_heads, tp)
    if cfg.mlp_hidden % tp:
        problems.append(f"TP {tp} does not divide the MLP width {cfg.mlp_hidden}")
    if problems:
        raise MeshSpecError(f"model {cfg.name!r} cannot run at TP {tp}: " + "; ".join(problems))


def head_problems(n_heads: int, n_kv_heads: int, tp: int) -> list[str]:
    """Why TP `tp` cannot split these attention heads (empty when it can); see `check_model_tp`."""
    problems = []
    if n_heads % tp:
        problems.append(f"TP {tp} does not divide the {n_heads} attention heads")
    if n_kv_heads >= tp and n_kv_heads % tp:
        problems.append(f"TP {tp} does not divide the {n_kv_heads} kv heads (fewer kv heads than TP "
                        "would be replicated, but this count would split a head)")
    if n_heads % n_kv_heads:
        problems.append(f"the {n_heads} attention heads are not a multiple of the {n_kv_heads} kv heads")
    return problems
