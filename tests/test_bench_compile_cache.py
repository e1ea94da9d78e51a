"""bench.compile_cache end to end on CPU: the second process loads every executable the first compiled."""
import json

import pytest

from dilaserve_jax.bench import compile_cache


@pytest.mark.slow
def test_a_second_process_loads_what_the_first_compiled(tmp_path, capsys):
    cache = tmp_path / "cache"
    cache.mkdir()
    status = compile_cache.main(["--model", "test", "--lengths", "32", "--slots", "2", "--cache-dir", str(cache),
                                 "--json"])
    assert status == 0
    cold, warm = json.loads(capsys.readouterr().out)
    assert cold["executables"] == warm["executables"] > 0
    assert cold["cache_files_before"] == 0 and cold["cache_files_after"] > 0
    assert warm["cache_files_after"] == warm["cache_files_before"] == cold["cache_files_after"]  # nothing compiled


def test_bad_arguments_are_usage_errors(capsys):
    assert compile_cache.main(["--passes", "0"]) == 2
    assert compile_cache.main(["--one-pass"]) == 2
