"""Measured latency profiles kept on disk between starts, keyed by what a step's time depends on.

A profile holds for one model (its name, and a hash of its checkpoint path and config), one device
kind, one TP degree and one grid of shapes (length, block and batch buckets, cache mode), measured
by one JAX version in one way. `ProfileKey` holds all of them and names the file; a start that
finds the file with the same key inside reads it instead of measuring. Computing the key reads no
weights. An unreadable, foreign or corrupt file counts as missing (and is measured again), and a
cache that cannot be written is only logged: the cache never stops a start.

Where it lives: `--profile-cache DIR`, else `latency-profiles` beside the compile cache directory
(`~/.cache/dilaserve_jax/latency-profiles` with the default compile cache, and also when the compile
cache is off); `none` turns it off.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from dilaserve_jax.serving.policy.latency import Profile

log = logging.getLogger(__name__)
PROFILE_FORMAT = 1  # raise when what a start-up measurement does changes: older files stop matching
CACHE_NAME = "latency-profiles"
DEFAULT_PROFILE_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "dilaserve_jax", CACHE_NAME)
OFF = "none"


@dataclass(frozen=True, slots=True)
class ProfileKey:
    model: str  # the config's name
    model_id: str  # `model_identity(source, config)`
    device: str  # platform and device kind, e.g. "gpu:NVIDIA H200"
    tp: int
    lengths: tuple[int, ...]
    blocks: tuple[int, ...]
    batches: tuple[int, ...]
    cache_mode: str
    runtime: str  # JAX version and PROFILE_FORMAT

    def as_json(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.as_json(), sort_keys=True).encode()).hexdigest()[:20]

    def file_name(self) -> str:
        return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', self.model)[:64]}-tp{self.tp}-{self.digest()}.json"


def model_identity(source: str, config) -> str:
    """A short hash of where the weights come from and the model's config (no weights are read)."""
    fields = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else repr(config)
    text = json.dumps({"source": str(source), "config": fields}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def profile_cache_dir(profile_cache: str | None, compile_cache: str | None) -> str | None:
    """The directory profiles are kept in: `profile_cache` when given ('none': no cache), else
    `latency-profiles` beside the compile cache, else the user's default cache directory."""
    if profile_cache is not None:
        return None if profile_cache == OFF else profile_cache
    if compile_cache in (None, OFF):
        return DEFAULT_PROFILE_CACHE
    return os.path.join(os.path.dirname(os.path.abspath(compile_cache)), CACHE_NAME)


class ProfileCache:
    def __init__(self, directory: str | Path):
        self.directory = Path(directory)

    def path(self, key: ProfileKey) -> Path:
        return self.directory / key.file_name()

    def load(self, key: ProfileKey) -> Profile | None:
        path = self.path(key)
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            if data.get("key") != key.as_json():
                return None
            return Profile.from_json(data["profile"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            log.warning("ignoring unreadable latency profile %s: %s", path, err)
            return None

    def save(self, key: ProfileKey, profile: Profile) -> Path | None:
        """Write atomically (a reader never sees half a file); None when it could not be written."""
        path = self.path(key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"key": key.as_json(), "profile": profile.to_json()}, indent=1))
            os.replace(tmp, path)
            return path
        except OSError as err:
            log.warning("could not keep the latency profile in %s: %s", self.directory, err)
            try:
                tmp.unlink(missing_ok=True)
            except OSError:  # the directory itself is unusable: nothing was written
                pass
            return None
