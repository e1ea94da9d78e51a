"""Generators are deterministic per seed; the held-out split never overlaps training."""
import numpy as np
import pytest

from dilaserve_jax.models.tokenizer import CharTokenizer
from dilaserve_jax.tasks.suite import (TASKS, UPPER_FIELD, field_prompt, problems, split_of, task,
                                       training_examples, unique_problems)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_problems_are_deterministic_per_seed(name):
    assert problems(name, "train", 40, seed=3) == problems(name, "train", 40, seed=3)
    assert problems(name, "train", 40, seed=3) != problems(name, "train", 40, seed=4)
    assert unique_problems(name, "heldout", 20, seed=1) == unique_problems(name, "heldout", 20, seed=1)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_heldout_split_is_disjoint_from_training(name):
    train = {p.canonical for p in problems(name, "train", 3000, seed=0)}
    heldout = {p.canonical for p in problems(name, "heldout", 300, seed=0)}
    assert train and heldout and not train & heldout
    assert all(split_of(name, c) == "heldout" for c in heldout)


def test_training_stream_never_yields_heldout_problems():
    seen = [p for (p, _), _ in zip(training_examples(seed=11), range(3000))]
    assert {p.task for p in seen} == set(TASKS)
    assert all(split_of(p.task, p.canonical) == "train" for p in seen)


def test_training_stream_is_deterministic():
    a = [x for x, _ in zip(training_examples(seed=2), range(200))]
    b = [x for x, _ in zip(training_examples(seed=2), range(200))]
    assert a == b


def test_canonical_form_ignores_presentation_order():
    t = task("repeat")
    assert t.canonical(("ab", 3)) == t.canonical(("ba", 3)) != t.canonical(("ab", 4))


@pytest.mark.parametrize("name", sorted(TASKS))
def test_prompts_and_answers_fit_the_declared_bounds(name):
    t, tok, rng = TASKS[name], CharTokenizer(), np.random.default_rng(0)
    for p in problems(name, "train", 500, seed=7):
        answer = t.answer(p.payload, rng)
        assert len(tok.encode(p.prompt)) <= t.max_prompt
        assert t.min_answer <= len(tok.encode(answer)) <= t.max_answer <= t.gen_length


def test_answer_lengths_span_one_to_several_blocks():
    longest = max(t.max_answer for t in TASKS.values())
    shortest = min(t.min_answer for t in TASKS.values())
    assert shortest <= 4 and longest > 2 * 32


def test_unknown_task_is_an_error():
    with pytest.raises(ValueError, match="unknown task"):
        task("nope")


def test_phrase_tasks_share_a_fixed_width_field():
    a, b = field_prompt("upper", "ab cd"), field_prompt("altcase", "ab cd")
    assert a.endswith("=") and len(a) - len("upper ") == len(b) - len("altcase ") == UPPER_FIELD + 1
    with pytest.raises(ValueError, match="at most"):
        field_prompt("upper", "x" * (UPPER_FIELD + 1))
    with pytest.raises(ValueError, match="without"):
        field_prompt("altcase", "a.b")
