"""The push benchmark, small: both placements agree bit for bit and every timing is reported."""
import pytest

from dilaserve_jax.bench.push import build_parser, main, run


@pytest.mark.slow
def test_push_benchmark_reports_both_methods_in_both_conditions(capsys):
    result = run(build_parser().parse_args(["--model", "test", "--repeats", "1", "--busy-threads", "1"]))
    assert result["identical"] is True and result["plan_first_ms"] > 0
    for cond in ("idle", "busy"):
        assert len(result[cond]["plan"]) == len(result[cond]["per_array"]) == 1
        assert all(v > 0 for v in result[cond]["plan"] + result[cond]["per_array"])
    assert main(["--repeats", "0"]) == 2 and "repeats >= 1" in capsys.readouterr().err
