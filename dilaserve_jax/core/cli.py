"""Command-line flags from configuration dataclasses: a field's name, default, help and validation
are written once, on the field (`slots: int = opt(16, "decode slots per instance")`).

`add_config_arguments(parser, Config)` adds `--kebab-name` per field (bools as `--x/--no-x`, Enum
and `choices` fields as choices, tuples as several values (each read by a `parse` given with
`nargs`), `T | None` as a T); the namespace keeps argparse's names for the flags (`--cache` ->
`args.cache`). `config_from_args(Config, args, parser)` builds the dataclass, whose `__post_init__`
validates: a ValueError is a usage error (exit 2).
`setup_logging` prints a command's log messages as the plain lines it always printed.
"""
from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import json
import logging
import os
import sys
import types
import typing
import weakref
from collections.abc import Callable, Sequence

METADATA_KEY = "flag"
# per parser, per config class, what add_config_arguments added: field -> (action, Flag, type)
_ADDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True, slots=True)
class Flag:
    """How a config field appears on the command line."""

    help: str
    name: str | None = None  # the flag's spelling when it is not the field's ("--cache" for cache_mode)
    aliases: tuple[str, ...] = ()  # further spellings that work too (older names)
    choices: tuple | None = None  # allowed values; an Enum field's are its values
    # the flag's text -> the field's value ("4-7" -> (4, 5, 6, 7)); a tuple field's with nargs: each value's
    parse: Callable[[str], object] | None = None
    metavar: str | None = None
    default_text: str | None = None  # what --help says the default is, when its value does not say it
    env: str | None = None  # an environment variable that, when set, is the default
    positional: bool = False
    nargs: str | None = None  # a tuple field's, when not "+" ("*": no values is a choice too)
    repeat: bool = False  # a tuple field given one value per use of the flag (--weights-root A --weights-root B)


def opt(default=dataclasses.MISSING, help: str = "", **flag):
    """A config field with its flag (keywords: `Flag`'s); a dict or list default is copied per instance."""
    metadata = {METADATA_KEY: Flag(help, **flag)}
    if isinstance(default, (dict, list, set)):
        return dataclasses.field(default_factory=functools.partial(type(default), default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def words(text: str) -> tuple[str, ...]:
    """A parse: "2x4, 8x1" -> ("2x4", "8x1") (comma-separated, blanks dropped)."""
    return tuple(w.strip() for w in text.split(",") if w.strip())


def or_none(kind: Callable[[str], object], *off: str) -> Callable[[str], object]:
    """A parse: any of the words `off` means None ("inf": unbounded, "0": disabled); else a `kind`."""
    return lambda text: None if text.strip().lower() in off else kind(text)


def add_config_arguments(parser: argparse.ArgumentParser, cls: type, *, only: Sequence[str] | None = None,
                         exclude: Sequence[str] = (), rename: dict[str, str] | None = None,
                         group: str | None = None) -> argparse.ArgumentParser:
    """One flag per field of the dataclass `cls` (those in `only`, less `exclude`), under the --help
    section `group`; `rename` maps a field to this command's spelling of its flag. A field to add
    without help raises TypeError: every flag says what it does."""
    hints = typing.get_type_hints(cls)
    added = _ADDED.setdefault(parser, {}).setdefault(cls, {})
    target = parser if group is None else next(
        (g for g in parser._action_groups if g.title == group), None) or parser.add_argument_group(group)
    for f in dataclasses.fields(cls):
        if f.name in exclude or (only is not None and f.name not in only):
            continue
        spec = f.metadata.get(METADATA_KEY)
        if spec is None or not spec.help:
            raise TypeError(f"{cls.__name__}.{f.name} has no help: declare it with opt(default, help)")
        added[f.name] = (_add(target, f, hints[f.name], spec, (rename or {}).get(f.name)), spec, hints[f.name])
    return parser


def config_from_args(cls: type, namespace: argparse.Namespace, parser: argparse.ArgumentParser, **given):
    """The dataclass from the flags add_config_arguments added for it, and the `given` fields. Text a
    flag's parse refuses, or a config `__post_init__` refuses, is a usage error (parser.error)."""
    kwargs = {}
    for name, (action, spec, hint) in _ADDED.get(parser, {}).get(cls, {}).items():
        value = getattr(namespace, action.dest)
        if name in given or (spec.repeat and value is None):  # a repeatable flag never given: the field's default
            continue
        try:
            kwargs[name] = _value(value, spec, hint)
        except (ValueError, TypeError, argparse.ArgumentTypeError) as err:  # the last: argparse's own idiom
            parser.error(f"argument {'/'.join(action.option_strings) or action.dest}: {err}")
    try:
        return cls(**kwargs, **given)
    except ValueError as err:
        parser.error(str(err))


def returns_exit_status(main: Callable[..., int]) -> Callable[..., int]:
    """`main(argv) -> int` returns argparse's exit status (2 after a usage error, 0 after --help)
    instead of raising it, so a caller in the same process reads every outcome as a status."""

    @functools.wraps(main)
    def run(*args, **kw) -> int:
        try:
            return main(*args, **kw)
        except SystemExit as stop:
            if stop.code is not None and not isinstance(stop.code, int):
                raise  # a message to print on the way out
            return stop.code or 0

    return run


class _Stderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is now (a test may have replaced it): the command's own messages
    as plain lines, the others as `fmt`."""

    stream = property(lambda self: sys.stderr, lambda self, value: None)

    def __init__(self, own: str, fmt: str):
        super().__init__()
        self.own, self.plain, self.formatter = own, logging.Formatter("%(message)s"), logging.Formatter(fmt)

    def format(self, record: logging.LogRecord) -> str:
        return (self.plain if record.name == self.own else self.formatter).format(record)


def setup_logging(log: logging.Logger | str = "__main__", *, verbose: bool = False, detailed: bool = False) -> None:
    """Messages of the command's logger `log` (INFO and up) print to stderr as plain lines, as the
    command always printed them; other loggers print warnings and up (INFO too when `verbose`),
    plain, or with time, level and name when `detailed`. A second call replaces the first."""
    own = logging.getLogger(log) if isinstance(log, str) else log
    handler = _Stderr(own.name, "%(asctime)s %(levelname)s %(name)s: %(message)s" if detailed else "%(message)s")
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Stderr)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    own.setLevel(logging.INFO)


def _add(target, f: dataclasses.Field, hint, spec: Flag, rename: str | None) -> argparse.Action:
    base, optional = _unwrap(hint)
    default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
    shown = _help(spec, default, base is bool)  # from the field's default: the environment's may be a secret
    if spec.env and os.environ.get(spec.env):
        default = os.environ[spec.env]
    kw: dict = {"metavar": spec.metavar} if spec.metavar else {}
    element, choices = base, spec.choices
    if typing.get_origin(base) is tuple and (spec.parse is None or spec.nargs):
        args = typing.get_args(base)
        element = args[0] if args else str
        if spec.repeat:
            kw["action"] = "append"
        else:
            kw["nargs"] = spec.nargs or ("+" if Ellipsis in args or not args else len(args))
    if isinstance(element, type) and issubclass(element, enum.Enum):
        choices = choices or tuple(element)
        element = type(next(iter(element)).value)
    if element is bool and spec.parse is None:
        kw["action"] = argparse.BooleanOptionalAction
    elif element in (int, float, str) and spec.parse is None:
        kw["type"] = element
    if choices is not None:
        kw["choices"] = tuple(c.value if isinstance(c, enum.Enum) else c for c in choices)
    if spec.positional:
        names = [f.name]
        if default is not dataclasses.MISSING or optional:
            kw["nargs"] = "?"
    else:
        names = [rename or spec.name or "--" + f.name.replace("_", "-"), *spec.aliases]
        kw["required"] = default is dataclasses.MISSING
    if default is not dataclasses.MISSING and not spec.repeat:  # append would add to a default list
        kw["default"] = default.value if isinstance(default, enum.Enum) else (
            list(default) if isinstance(default, tuple) else default)
    action = target.add_argument(*names, **kw)
    action.help = shown  # set afterwards: some Pythons' BooleanOptionalAction append a default of their own
    return action


def _unwrap(hint) -> tuple[object, bool]:
    """(the type inside `T | None`, whether None is allowed)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(inner) == 1:
            return inner[0], True
    return hint, False


def _value(value, spec: Flag, hint):
    """The field's value from the namespace's: parsed text, a tuple for a list, an Enum for its value."""
    base, _ = _unwrap(hint)
    if spec.parse is not None and isinstance(value, str):
        return spec.parse(value)
    if typing.get_origin(base) is tuple and isinstance(value, list):
        args = typing.get_args(base)
        each = Flag("", parse=spec.parse)  # with nargs, the parse reads each value
        return tuple(_value(v, each, args[0]) for v in value) if Ellipsis in args else tuple(value)
    if isinstance(base, type) and issubclass(base, enum.Enum) and value is not None:
        return base(value)
    return value


def _help(spec: Flag, default, is_bool: bool) -> str:
    if spec.default_text is not None:
        shown = f" (default: {spec.default_text})" if spec.default_text else ""
    else:
        value = "" if default is dataclasses.MISSING or default is None else _show(default, is_bool)
        shown = f" (default {value})" if value else ""
    return (spec.help + shown).replace("%", "%%")  # argparse %-formats help


def _show(value, is_bool: bool = False) -> str:
    if is_bool:
        return "on" if value else "off"
    if isinstance(value, (tuple, list, frozenset, set)):
        return " ".join(map(_show, value))
    if isinstance(value, enum.Enum):
        return str(value.value)
    return json.dumps(value) if isinstance(value, dict) else f"{value:g}" if isinstance(value, float) else str(value)
