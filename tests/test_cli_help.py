"""Every command's --help says what it does and what each of its flags does."""
import importlib

import pytest

COMMANDS = ("serve", "generate", "client", "tasks.train", "tasks.eval", "sim.__main__", "sim.evaluate",
            "sim.synth_trace",
            *(f"bench.{b}" for b in ("attention", "decode", "overlap", "profile", "push", "reconfigure", "reshard",
                                     "serving", "soak", "policies", "sim_validate", "trace_diff",
                                     "host_time", "hosts_controller", "compile_cache")))
CACHE_FLAG = ("serve", "tasks.eval", "bench.profile", "bench.reconfigure")


def parser_of(command: str):
    return importlib.import_module(f"dilaserve_jax.{command}").build_parser()


@pytest.mark.parametrize("command", COMMANDS)
def test_help_describes_the_command_and_every_flag(command):
    parser = parser_of(command)
    assert parser.description and parser.prog == "python -m dilaserve_jax." + command.removesuffix(".__main__")
    undocumented = [a.option_strings or a.dest for a in parser._actions if not a.help]
    assert not undocumented
    parser.format_help()  # every help text formats (a stray % would raise here)


@pytest.mark.parametrize("command", CACHE_FLAG)
def test_the_cache_mode_is_spelled_cache_and_the_old_spelling_still_works(command):
    parser = parser_of(command)
    required = ["--out", "x"] if command == "bench.profile" else []
    new, old = (parser.parse_args(required + [flag, "none"]) for flag in ("--cache", "--cache-mode"))
    assert new == old and new.cache == "none"
