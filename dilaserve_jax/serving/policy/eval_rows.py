"""The rows of `python -m dilaserve_jax.tasks.eval --json`, read as the threshold controller's priors:
τ -> tokens committed per step and τ -> accuracy, pooled over tasks."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Mapping, Sequence


EVAL_ROW_KEYS = ("task", "threshold", "accuracy", "tokens_per_step", "steps", "n")


def read_eval_rows(path_or_rows: str | Path | Iterable[Mapping], tasks: Sequence[str] | None = None
                   ) -> list[dict]:
    """The per-task rows of `python -m dilaserve_jax.tasks.eval --json`, checked.

    Every row must carry task, threshold, accuracy, tokens_per_step, steps and n (files written
    before the accuracy model existed, or hand-made speed-only priors, are refused: the threshold
    controller needs accuracy beside speed). A file with only summary rows yields its `mean:all`
    rows. `tasks` keeps only those tasks.
    """
    source = path_or_rows if isinstance(path_or_rows, (str, Path)) else "eval rows"
    rows = path_or_rows
    if isinstance(rows, (str, Path)):
        rows = json.loads(Path(rows).read_text())
    if not isinstance(rows, list):
        raise ValueError(f"{source}: expected a JSON list of eval rows")
    rows = [dict(r) for r in rows]
    for i, r in enumerate(rows):
        missing = [k for k in EVAL_ROW_KEYS if k not in r]
        if missing:
            raise ValueError(f"{source}: row {i} has no {', '.join(missing)} (rows of `python -m "
                             f"dilaserve_jax.tasks.eval --json` carry {', '.join(EVAL_ROW_KEYS)}; the threshold "
                             f"controller needs accuracy as well as tokens per step)")
    per_task = [r for r in rows if r.get("kind") != "summary" and (tasks is None or r["task"] in tasks)]
    if not per_task and tasks is None:
        per_task = [r for r in rows if r.get("task") == "mean:all"]
    per_task = [r for r in per_task if 0.0 < float(r["threshold"]) <= 1.0 and float(r["n"]) > 0]
    if not per_task:
        raise ValueError(f"{source}: no usable eval rows (need per-task rows with a threshold in (0, 1] and n > 0)")
    for r in per_task:
        if not 0.0 <= float(r["accuracy"]) <= 1.0:
            raise ValueError(f"{source}: accuracy of {r['task']} at τ={r['threshold']} is not in [0, 1]")
    return per_task


def prior_from_eval_json(path_or_rows: str | Path | Iterable[Mapping], tasks: Sequence[str] | None = None
                         ) -> dict[float, float]:
    """τ -> tokens committed per step from the rows of `python -m dilaserve_jax.tasks.eval --json`.

    Per-task rows are pooled (total tokens / total steps: a task with longer answers weighs more,
    as it does in serving); a file with only summary rows uses its `mean:all` rows. `tasks` keeps
    only those tasks. Values are clamped to >= 1 (the argmax always commits).
    """
    rows = read_eval_rows(path_or_rows, tasks)
    summary_only = all(r.get("kind") == "summary" for r in rows)
    tokens: dict[float, float] = {}
    steps: dict[float, float] = {}
    for r in rows:
        tau = float(r["threshold"])
        w = float(r["n"]) if summary_only else float(r["steps"]) * float(r["n"])
        if w <= 0:
            continue
        tokens[tau] = tokens.get(tau, 0.0) + float(r["tokens_per_step"]) * w
        steps[tau] = steps.get(tau, 0.0) + w
    if not steps:
        raise ValueError("eval rows hold no threshold with steps > 0")
    return {tau: max(1.0, tokens[tau] / steps[tau]) for tau in sorted(steps, reverse=True)}


def accuracy_from_eval_json(path_or_rows: str | Path | Iterable[Mapping], tasks: Sequence[str] | None = None
                            ) -> dict[float, float]:
    """τ -> expected accuracy (valid-answer rate in [0, 1]) from the same rows as the speed prior.

    Pooled over the same rows: correct answers / problems (each problem counts once, as each
    request does in serving), so tasks weigh by how many problems were measured.
    """
    correct: dict[float, float] = {}
    total: dict[float, float] = {}
    for r in read_eval_rows(path_or_rows, tasks):
        tau, n = float(r["threshold"]), float(r["n"])
        correct[tau] = correct.get(tau, 0.0) + float(r["accuracy"]) * n
        total[tau] = total.get(tau, 0.0) + n
    return {tau: correct[tau] / total[tau] for tau in sorted(total, reverse=True)}


def describe_priors(rows: Sequence[Mapping]) -> str:
    """One line of the speed and accuracy priors the rows give, per τ (for start-up logs)."""
    prior, acc = prior_from_eval_json(rows), accuracy_from_eval_json(rows)
    return ", ".join(f"τ={t:g} {v:.2f} tok/step {100 * acc[t]:.1f}%" for t, v in prior.items())


def eval_rows_beside(model_source: str) -> Path | None:
    """The first eval*.json in the directory a model was loaded from ("hf:DIR", "orbax:DIR@step")."""
    directory = Path(model_source.split(":", 1)[-1].split("@")[0])
    return next(iter(sorted(directory.glob("eval*.json"))), None) if directory.is_dir() else None
