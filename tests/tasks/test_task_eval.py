"""Evaluation: option validation, rows and table; the fast decoder is wired in."""
import pytest

from dilaserve_jax.decoding.commit import CONFIDENCE_BINS
from dilaserve_jax.models import load_model
from dilaserve_jax.tasks.eval import EvalConfig, evaluate, format_table, main, summary_rows


def test_eval_config_validates():
    with pytest.raises(ValueError):
        EvalConfig(thresholds=(0.0,))
    with pytest.raises(ValueError):
        EvalConfig(tasks=("nope",))
    with pytest.raises(ValueError):
        EvalConfig(decoder="magic")


def test_summary_rows_and_table():
    rows = [{"task": "a", "kind": "deterministic", "threshold": 1.0, "accuracy": 1.0, "tokens_per_step": 1.0, "steps": 4.0, "n": 2},
            {"task": "b", "kind": "multi-answer", "threshold": 1.0, "accuracy": 0.5, "tokens_per_step": 3.0, "steps": 2.0, "n": 2}]
    summary = {r["task"]: r for r in summary_rows(rows)}
    assert summary["mean:all"]["accuracy"] == 0.75 and summary["mean:multi-answer"]["tokens_per_step"] == 3.0
    table = format_table(rows + list(summary.values()))
    assert "mean:all" in table and "75.0%" in table


def test_evaluate_rows_have_the_documented_keys():
    model = load_model("test")  # random weights: only the shape of the output is checked
    rows = evaluate(EvalConfig(model="test", thresholds=(1.0, 0.3), per_task=2, tasks=("repeat",)), model,
                    progress=False)
    task_rows = [r for r in rows if r["task"] == "repeat"]
    assert [r["threshold"] for r in task_rows] == [1.0, 0.3]
    for r in task_rows:
        assert {"task", "threshold", "accuracy", "tokens_per_step", "steps", "answer_length"} <= set(r)
        assert 0.0 <= r["accuracy"] <= 1.0 and r["steps"] >= 1 and r["tokens_per_step"] >= 1.0
        assert r["answer_length"] == 12
        # first-step signature: shares per confidence bin of the first block's masked positions
        assert len(r["first_step_confidence"]) == CONFIDENCE_BINS and abs(sum(r["first_step_confidence"]) - 1.0) < 1e-3
    assert task_rows[0]["first_step_confidence"] == task_rows[1]["first_step_confidence"]  # τ-independent
    for r in task_rows:  # per problem: its commits per step (they make up the pooled rate), validity, prompt id
        assert len(r["trajectories"]) == len(r["valid"]) == len(r["prompt_hash"]) == r["n"] == 2
        steps = sum(len(t) for t in r["trajectories"])
        assert steps == r["steps"] * r["n"] and all(n >= 1 for t in r["trajectories"] for n in t)
        assert abs(sum(map(sum, r["trajectories"])) / steps - r["tokens_per_step"]) < 1e-9
        assert sum(r["valid"]) == r["accuracy"] * r["n"] and len(set(r["prompt_hash"])) == 2
    assert task_rows[0]["prompt_hash"] == task_rows[1]["prompt_hash"]  # the same problems at every τ


def test_cli_rejects_bad_thresholds(capsys):
    assert main(["--model", "test", "--thresholds", "1.5"]) == 2
    assert "thresholds" in capsys.readouterr().err
