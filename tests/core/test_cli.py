"""Flags from config dataclasses: names, defaults, help, choices and validation come from the fields."""
import argparse
import logging
from dataclasses import dataclass, field
from enum import Enum

import pytest

from dilaserve_jax.core.cli import (add_config_arguments, config_from_args, opt, or_none, returns_exit_status,
                                    setup_logging, words)


class Colour(str, Enum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True, slots=True)
class Demo:
    prompt: str | None = opt(None, "prompt text", positional=True)
    slots: int = opt(4, "decode slots per instance")
    cache_mode: str = opt("dual", "KV cache mode", name="--cache", aliases=("--cache-mode",),
                          choices=("none", "prefix", "dual"))
    colour: Colour = opt(Colour.RED, "a colour")
    taus: tuple[float, ...] = opt((1.0, 0.9), "thresholds")
    json: bool = opt(False, "print JSON")
    progress: bool = opt(True, "progress bars on stderr")
    budget: float | None = opt(1.0, "points, or inf", parse=or_none(float, "inf"))
    layouts: tuple[str, ...] = opt((), "comma-separated layouts", parse=words, default_text="all of them")
    roots: tuple[str, ...] = opt((), "a directory (repeatable)", name="--root", repeat=True)
    token: str | None = opt(None, "a secret", env="DEMO_TOKEN")

    def __post_init__(self):
        if self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots}")


def parser_for(cls=Demo) -> argparse.ArgumentParser:
    return add_config_arguments(argparse.ArgumentParser(prog="demo", description="a demo command"), cls)


def parse(*argv: str) -> Demo:
    p = parser_for()
    return config_from_args(Demo, p.parse_args(list(argv)), p)


def test_no_flags_give_the_dataclass_defaults():
    assert parse() == Demo()


def test_each_field_is_a_flag_of_its_kebab_name_or_its_own_spelling():
    got = parse("hi", "--slots", "8", "--cache-mode", "prefix", "--taus", "0.5", "0.7", "--layouts", "2x4, 8x1",
                "--root", "a", "--root", "b", "--budget", "inf")
    assert got == Demo(prompt="hi", slots=8, cache_mode="prefix", taus=(0.5, 0.7), layouts=("2x4", "8x1"),
                       roots=("a", "b"), budget=None)
    assert parse("--cache", "none").cache_mode == "none"
    assert parser_for().parse_args(["--cache", "none"]).cache == "none"  # argparse's name for the flag


def test_enum_fields_offer_their_values_and_build_the_member(capsys):
    assert parse("--colour", "blue").colour is Colour.BLUE
    with pytest.raises(SystemExit) as stop:
        parse("--colour", "green")
    assert stop.value.code == 2 and "invalid choice: 'green' (choose from 'red', 'blue')" in capsys.readouterr().err


def test_bools_are_on_off_pairs():
    assert parse("--json").json is True and parse("--no-json").json is False
    assert parse("--no-progress").progress is False and parse().progress is True


def test_help_says_what_each_flag_does_and_its_default(capsys, monkeypatch):
    monkeypatch.setenv("DEMO_TOKEN", "s3cret")
    p = parser_for()
    assert p.parse_args([]).token == "s3cret"  # the environment's default ...
    with pytest.raises(SystemExit):
        p.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for text in ("a demo command", "decode slots per instance (default 4)", "--cache {none,prefix,dual}, --cache-mode",
                 "thresholds (default 1 0.9)", "--json, --no-json print JSON (default off)",
                 "comma-separated layouts (default: all of them)", "a colour (default red)"):
        assert text in out
    assert "s3cret" not in out  # ... which --help never shows
    assert "a directory (repeatable) --token" in out  # an empty default is not shown


def test_validation_errors_are_usage_errors_with_the_message(capsys):
    with pytest.raises(SystemExit) as stop:
        parse("--slots", "0")
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: demo") and "demo: error: slots must be >= 1, got 0" in err
    with pytest.raises(SystemExit):
        parse("--budget", "lots")
    assert "argument --budget: could not convert string to float: 'lots'" in capsys.readouterr().err


def test_a_parse_that_raises_argparses_own_error_is_a_usage_error_too(capsys):
    def positive(text):
        if float(text) <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} is not positive")
        return float(text)

    @dataclass(frozen=True, slots=True)
    class Rate:
        rate: float = opt(1.0, "a rate", parse=positive)

    p = parser_for(Rate)
    assert config_from_args(Rate, p.parse_args(["--rate", "2"]), p) == Rate(2.0)
    with pytest.raises(SystemExit) as stop:
        config_from_args(Rate, p.parse_args(["--rate", "-1"]), p)
    assert stop.value.code == 2 and "argument --rate: '-1' is not positive" in capsys.readouterr().err


def test_main_returns_the_usage_error_status(capsys):
    @returns_exit_status
    def main(argv):
        parse(*argv)
        return 0

    assert main(["--slots", "0"]) == 2 and "slots must be >= 1" in capsys.readouterr().err
    assert main(["--help"]) == 0 and main([]) == 0


def test_a_field_without_help_is_refused():
    @dataclass(frozen=True, slots=True)
    class Undocumented:
        steps: int = 3

    @dataclass(frozen=True, slots=True)
    class EmptyHelp:
        steps: int = opt(3, "")

    for cls in (Undocumented, EmptyHelp):
        with pytest.raises(TypeError, match="steps has no help"):
            parser_for(cls)


def test_only_exclude_rename_and_given_fields():
    @dataclass(frozen=True, slots=True)
    class Controller:
        interval_s: float = opt(2.0, "seconds between decisions")
        window_s: float = field(default=30.0)  # never a flag here

    p = argparse.ArgumentParser()
    add_config_arguments(p, Demo, only=("slots",))
    add_config_arguments(p, Controller, only=("interval_s",), rename={"interval_s": "--controller-interval-s"})
    args = p.parse_args(["--controller-interval-s", "5", "--slots", "2"])
    assert config_from_args(Controller, args, p) == Controller(interval_s=5.0)
    assert config_from_args(Demo, args, p, prompt="x") == Demo(prompt="x", slots=2)
    assert not hasattr(args, "json")


@pytest.fixture
def restored_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_setup_logging_prints_the_commands_messages_as_plain_lines(capsys, restored_logging):
    own, other = logging.getLogger("demo.command"), logging.getLogger("demo.library")
    setup_logging(own)
    own.info("compiled 4 shapes")
    other.info("a library detail")
    other.warning("a library warning")
    assert capsys.readouterr().err == "compiled 4 shapes\na library warning\n"
    setup_logging(own, verbose=True, detailed=True)
    own.info("ready")
    other.info("reloaded")
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "ready" and lines[1].endswith("INFO demo.library: reloaded") and len(lines) == 2
