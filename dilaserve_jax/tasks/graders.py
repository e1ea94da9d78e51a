"""Exact graders: does an answer string solve a problem? One pure function per task."""
from __future__ import annotations

from collections import Counter
from typing import Callable

from dilaserve_jax.tasks.suite import Problem


def _sort(payload: tuple, answer: str) -> bool:
    return answer == "".join(sorted(payload[0]))


def _upper(payload: tuple, answer: str) -> bool:
    return answer == payload[0].upper()


def _anagram(payload: tuple, answer: str) -> bool:
    return Counter(answer) == Counter(payload[0])  # any arrangement of exactly these letters


def _pick(payload: tuple, answer: str) -> bool:
    return answer in payload  # any one of the listed words, exactly


GRADERS: dict[str, Callable[[tuple, str], bool]] = {
    "sort": _sort, "upper": _upper, "anagram": _anagram, "pick": _pick,
}


def grade(problem: Problem, answer: str) -> bool:
    """True if `answer` (the decoded text before the first EOS) is a valid answer to `problem`."""
    try:
        grader = GRADERS[problem.task]
    except KeyError:
        raise ValueError(f"no grader for task {problem.task!r}") from None
    return grader(problem.payload, answer)
