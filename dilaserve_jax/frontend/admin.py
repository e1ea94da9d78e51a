"""Guards for administrative calls: where weights may be reloaded from, and bounded messages."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

MAX_DETAIL_CHARS = 1024  # gRPC carries details in a header; keep every message far below its limits
MAX_PATH_BYTES = 4096
PRESET_NAMES = frozenset({"tiny", "test"})  # read only package data (or nothing) from disk


def bounded(text: str, limit: int = MAX_DETAIL_CHARS) -> str:
    """`text` cut to `limit` characters, saying how much was left out."""
    text = str(text)
    if len(text) <= limit:
        return text
    keep = max(0, limit - 40)
    return f"{text[:keep]}... [{len(text) - keep} more characters]"


def model_directory(model_source: str) -> Path | None:
    """The directory a served model was loaded from ("hf:DIR", "orbax:DIR@step"), if any."""
    kind, _, rest = model_source.partition(":")
    if kind not in ("hf", "orbax") or not rest:
        return None
    return Path(rest.rsplit("@", 1)[0] if kind == "orbax" else rest)


def weights_roots(model_source: str, extra: Iterable[str | Path] = ()) -> tuple[Path, ...]:
    """The directories reloads may read: the served model's own, plus any given ones."""
    roots = [Path(p) for p in extra]
    own = model_directory(model_source)
    if own is not None:
        roots.insert(0, own)
    return tuple(dict.fromkeys(r.expanduser().resolve() for r in roots))


def reload_refusal(directory: str, roots: Iterable[Path]) -> str | None:
    """Why a reload from `directory` is not allowed (None: it is). Symbolic links are resolved
    before the check, so a link inside a root cannot lead outside it."""
    if directory in PRESET_NAMES and not Path(directory).exists():
        return None
    roots = tuple(roots)
    real = Path(directory).expanduser().resolve()
    if any(real == r or r in real.parents for r in roots):
        return None
    allowed = ", ".join(str(r) for r in roots) or "none"
    return bounded(f"directory: {directory!r} is outside the weights roots ({allowed}); start the server with "
                   "--weights-root DIR to allow reloads from DIR")
