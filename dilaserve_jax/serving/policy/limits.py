"""Request limits and the serving defaults: the one place `serve`, `ServeConfig` and request
validation read them from (pure Python)."""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_NEW_TOKENS = 12  # the tiny model's short-task answer area; raise it for real checkpoints
DEFAULT_BLOCK_LENGTH = 32
DEFAULT_SLO_MS = 10_000.0
DEFAULT_TAU_MIN = 0.5
DEFAULT_TAU_MAX = 1.0
DEFAULT_MAX_QUEUE = 256
DEFAULT_SLOTS = 8
DEFAULT_STEP_TIMEOUT_S = 120.0  # watchdog: a runner call longer than this fails its instance
MAX_PROMPT_CHARS = 65_536
MAX_REQUEST_ID_CHARS = 128


@dataclass(frozen=True, slots=True)
class Limits:
    """Server-side bounds and defaults for requests."""

    max_len: int  # the model's canvas limit: prompt + answer area
    vocab_size: int
    reserved_ids: frozenset[int]  # mask, pad: never valid in a prompt
    default_max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    default_block_length: int = DEFAULT_BLOCK_LENGTH
    default_slo_ms: float = DEFAULT_SLO_MS
    default_tau_min: float = DEFAULT_TAU_MIN
    default_tau_max: float = DEFAULT_TAU_MAX
    max_block_length: int = DEFAULT_BLOCK_LENGTH
    max_prompt_chars: int = MAX_PROMPT_CHARS

    def __post_init__(self):
        if self.default_max_new_tokens <= 0 or self.default_block_length <= 0:
            raise ValueError("default max new tokens and block length must be positive")
        if not 0 < self.default_tau_min <= self.default_tau_max <= 1:
            raise ValueError("need 0 < default tau_min <= default tau_max <= 1")
        if self.default_slo_ms <= 0:
            raise ValueError("default SLO must be positive")
