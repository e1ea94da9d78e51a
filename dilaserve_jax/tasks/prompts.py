"""Stable ids of prompts: the eval rows name each measured prompt so, and the simulator finds a
request's own measured trajectory by the same id."""
from __future__ import annotations

import hashlib


def prompt_hash(token_ids) -> str:
    """A short stable id of a prompt's token ids."""
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:16]
