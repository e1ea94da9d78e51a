"""Step kinds and cache modes: one spelling from the scheduler's plan down to the compiled step.

Strings appear only at the edges (a latency profile's JSON, the proto, a CLI flag) and are turned
into these enums there, by `StepKind.parse` / `CacheMode(...)`.
"""
from __future__ import annotations

from enum import Enum, IntEnum


class StepKind(IntEnum):
    """REFRESH: full-canvas forward that rewrites the KV cache (first step of every block, and the
    first step after admission or migration). REUSE: only the current block's tokens, against the
    cached K/V. They have different shapes, so one batch holds one kind."""

    REFRESH = 0
    REUSE = 1

    @property
    def label(self) -> str:
        """The edge spelling: "refresh" / "reuse" (profile JSON, proto, logs)."""
        return self.name.lower()

    @classmethod
    def parse(cls, text: "str | StepKind") -> "StepKind":
        """From its edge spelling (case-insensitive) or a StepKind."""
        if isinstance(text, StepKind):
            return text
        try:
            return cls[str(text).strip().upper()]
        except KeyError:
            raise ValueError(f"unknown step kind {text!r}; expected one of {[k.label for k in cls]}") from None


class CacheMode(str, Enum):
    """How reuse steps use the approximate KV cache.

    NONE: every step is a full forward (exact baseline; no cache is allocated).
    PREFIX: reuse steps recompute the current block and everything after it, against the cached
      K/V of the prefix.
    DUAL: reuse steps compute the current block only, against cached K/V on both sides.
    """

    NONE = "none"
    PREFIX = "prefix"
    DUAL = "dual"

    def __str__(self) -> str:
        return self.value


CACHE_MODES: tuple[str, ...] = tuple(m.value for m in CacheMode)
