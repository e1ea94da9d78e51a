"""The decode benchmark's CLI surface and table formatting (the benchmark itself is not a test)."""
import pytest

from dilaserve_jax.bench.decode import BenchConfig, build_parser, format_tables


def test_help_describes_the_benchmark(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--help"])
    assert exit_info.value.code == 0
    assert "refresh" in capsys.readouterr().out


def test_config_validation():
    with pytest.raises(ValueError):
        BenchConfig(taus=(1.5,))
    with pytest.raises(ValueError):
        BenchConfig(caches=("lru",))


def test_table_marks_missing_reuse_steps():
    row = {"cache": "none", "tau": 1.0, "batch": 1, "tokens_per_s": 10.0, "speedup_vs_none_tau1": 1.0,
           "steps_per_request": 16.0, "accuracy": 0.5, "refresh_ms": 3.0, "reuse_ms": None,
           "refresh_over_reuse": None, "reuse_steps": 0}
    step = {"model": "tiny", "layers": 4, "batch": 1, "canvas": 256, "block": 32, "refresh_ms": 9.0,
            "reuse_ms": 3.0, "refresh_over_reuse": 3.0}
    table = format_tables([row], [step])
    assert "none" in table and "tiny (4 layers)" in table and " - " in table.splitlines()[2] + " "


def test_scaling_rejects_non_positive_slot_shard_and_process_counts(capsys):
    from dilaserve_jax.bench.decode import main

    assert main(["--scaling", "--slot-shards", "0", "--no-progress"]) == 2
    assert "--slot-shards must be positive" in capsys.readouterr().err
    assert main(["--scaling", "--processes", "0", "--no-progress"]) == 2
    assert "--processes must be positive, got 0" in capsys.readouterr().err
