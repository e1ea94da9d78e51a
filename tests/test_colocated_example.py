"""examples/colocated_training.py in short: train on devices 0-3, serve on 4-7 (four TP-1 instances),
push twice, a gRPC client grading held-out prompts throughout; nothing fails, the accuracy rises."""
import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "colocated_training.py"


def test_the_colocated_training_example_runs_in_short():
    spec = importlib.util.spec_from_file_location("colocated_training", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example  # its dataclasses look their module up
    spec.loader.exec_module(example)
    args = example.build_parser().parse_args(
        ["--steps", "6", "--push-every", "3", "--batch-tokens", "1024", "--lr", "2e-3", "--prompts", "6",
         "--mesh", "4x1", "--cache", "none", "--slots", "2", "--compile-cache", "none"])
    lines = []
    summary = example.run(args, say=lines.append)
    assert summary["pushes"] == 2 and summary["failed_calls"] == 0 and summary["drained"]
    rounds = summary["rounds"]
    assert rounds[0]["weights"] == "weakened:initial" and rounds[-1]["weights"] == "step 6"
    assert all(r["total"] == 12 for r in rounds)
    assert summary["final_accuracy"] > summary["baseline_accuracy"]
    assert sum("swapped in" in line for line in lines) == 2
