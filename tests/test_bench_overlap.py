"""The overlap benchmark runs end to end on two CPU devices with the shipped model."""
import json

from dilaserve_jax.bench.overlap import main


def test_overlap_benchmark_runs_on_the_shipped_model(capsys):
    assert main(["--requests", "3", "--slots", "2", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["serial_s"] > 0 and row["concurrent_s"] > 0
