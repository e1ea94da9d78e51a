"""Graders accept every valid answer and reject wrong ones (property tests over generated problems)."""
import string

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dilaserve_jax.tasks.graders import GRADERS, grade
from dilaserve_jax.tasks.suite import DETERMINISTIC, MULTI, TASKS, Problem, alternate_case, draw_problem

PRINTABLE = string.ascii_letters + string.digits + " "


def _problem(name: str, seed: int) -> Problem:
    return draw_problem(TASKS[name], "train", np.random.default_rng(seed))


def _mutations(answer: str):
    """Answers that differ from `answer`: one character replaced, dropped or added."""
    return st.one_of(
        st.tuples(st.integers(0, max(len(answer) - 1, 0)), st.sampled_from(PRINTABLE)).map(
            lambda t: answer[:t[0]] + t[1] + answer[t[0] + 1:]),
        st.integers(0, max(len(answer) - 1, 0)).map(lambda i: answer[:i] + answer[i + 1:]),
        st.tuples(st.integers(0, len(answer)), st.sampled_from(PRINTABLE)).map(
            lambda t: answer[:t[0]] + t[1] + answer[t[0]:]),
    )


def test_every_task_has_a_grader_and_both_kinds_exist():
    assert set(GRADERS) == set(TASKS)
    assert {t.kind for t in TASKS.values()} == {DETERMINISTIC, MULTI}


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(sorted(TASKS)), seed=st.integers(0, 2**32 - 1), answer_seed=st.integers(0, 2**32 - 1))
def test_sampled_training_answers_are_valid(name, seed, answer_seed):
    p = _problem(name, seed)
    answer = TASKS[name].answer(p.payload, np.random.default_rng(answer_seed))
    assert grade(p, answer)
    assert TASKS[name].min_answer <= len(answer) <= TASKS[name].max_answer


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(sorted(n for n, t in TASKS.items() if t.kind == DETERMINISTIC)),
       seed=st.integers(0, 2**32 - 1), data=st.data())
def test_deterministic_graders_reject_any_other_answer(name, seed, data):
    p = _problem(name, seed)
    right = TASKS[name].answer(p.payload, np.random.default_rng(0))
    wrong = data.draw(_mutations(right))
    assume(wrong != right)
    assert not grade(p, wrong)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), data=st.data())
def test_repeat_accepts_either_letter_n_times_and_nothing_else(seed, data):
    p = _problem("repeat", seed)
    letters, n = p.payload
    assert len(set(letters)) == 2 and 2 <= n <= 6
    for c in letters:
        assert grade(p, c * n)
    wrong = data.draw(st.one_of(_mutations(letters[0] * n), st.just(letters * n), st.just(letters[0] * (n + 1))))
    assume(wrong not in (letters[0] * n, letters[1] * n))
    assert not grade(p, wrong)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), data=st.data())
def test_altcase_accepts_both_alternations_and_nothing_else(seed, data):
    p = _problem("altcase", seed)
    phrase = p.payload[0]
    both = {alternate_case(phrase, True), alternate_case(phrase, False)}
    assert len(both) == 2
    for answer in both:
        assert grade(p, answer)
    wrong = data.draw(st.one_of(_mutations(data.draw(st.sampled_from(sorted(both)))),
                                st.just(phrase), st.just(phrase.upper())))
    assume(wrong not in both)
    assert not grade(p, wrong)


def test_alternate_case_alternates_by_character_index():
    assert alternate_case("ab cd", True) == "Ab cD" and alternate_case("ab cd", False) == "aB Cd"


def test_multi_answer_positions_split_between_answers():
    # Every letter position of repeat and altcase is one of two values with probability 1/2: parallel
    # commits at a low threshold can mix the two answers, sequential decoding cannot.
    rng = np.random.default_rng(0)
    for name in ("repeat", "altcase"):
        p = _problem(name, 5)
        answers = [TASKS[name].answer(p.payload, rng) for _ in range(400)]
        assert len(set(answers)) == 2 and 0.4 < answers.count(answers[0]) / 400 < 0.6


def test_graders_are_exact_about_case_and_whitespace():
    p = Problem("sort", TASKS["sort"].prompt_of(("312",)), ("312",))
    assert grade(p, "123") and not grade(p, "123 ") and not grade(p, " 123") and not grade(p, "")
    p = Problem("upper", TASKS["upper"].prompt_of(("ab cd",)), ("ab cd",))
    assert grade(p, "AB CD") and not grade(p, "ABCD") and not grade(p, "AB  CD")
