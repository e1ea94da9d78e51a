"""Reading a checkpoint's small JSON files with errors that name the file."""
from __future__ import annotations

import json
from pathlib import Path


def read_json(path: str | Path) -> dict:
    """A JSON object from `path`; ValueError naming the file if it is not one."""
    path = Path(path)
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a JSON file ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def build_from_json(cls, data: dict, path: str | Path):
    """`cls(**data)`, with a ValueError naming the file when the fields do not fit."""
    try:
        return cls(**data)
    except TypeError as err:
        raise ValueError(f"{path}: not a {cls.__name__} ({err})") from None
