"""The synthetic trace writer: the simulator reads what it writes, with the shape asked for."""
import numpy as np

from dilaserve_jax.sim.synth_trace import main
from dilaserve_jax.sim.workload import load_trace


def test_a_written_trace_reads_back_with_the_medians_and_burstiness_asked_for(tmp_path):
    out = tmp_path / "conv.csv"
    assert main(["--out", str(out), "--rows", "4000", "--prompt-median", "1000", "--answer-median", "120",
                 "--mean-gap-s", "0.05", "--gap-cv", "2"]) == 0
    trace = load_trace(out)
    assert len(trace) == 4000
    assert 900 < np.median(trace.context) < 1100 and 105 < np.median(trace.generated) < 135
    assert trace.context.max() <= 4000 and trace.generated.min() >= 1
    gaps = np.diff(trace.times)
    assert 0.04 < gaps.mean() < 0.06 and 1.6 < gaps.std() / gaps.mean() < 2.4  # bursty, not Poisson
    again = tmp_path / "again.csv"
    main(["--out", str(again), "--rows", "4000", "--prompt-median", "1000", "--answer-median", "120",
          "--mean-gap-s", "0.05", "--gap-cv", "2"])
    assert again.read_text() == out.read_text()  # seeded


def test_bad_input_is_a_usage_error(capsys):
    assert main(["--rows", "0"]) == 2
    assert "--rows must be >= 1" in capsys.readouterr().err


def test_timestamps_roll_over_past_midnight():
    from dilaserve_jax.sim.synth_trace import timestamp
    assert timestamp(6 * 3600 + 5.5) == "2023-11-17 00:00:05.500000"  # six hours after 18:00
