"""Exact graders: does an answer string solve a problem? One pure function per task."""
from __future__ import annotations

from typing import Callable

from dilaserve_jax.tasks.suite import Problem, alternate_case


def _sort(payload: tuple, answer: str) -> bool:
    return answer == "".join(sorted(payload[0]))


def _upper(payload: tuple, answer: str) -> bool:
    return answer == payload[0].upper()


def _repeat(payload: tuple, answer: str) -> bool:
    letters, n = payload
    return any(answer == c * n for c in letters)  # any one of the letters, written n times


def _altcase(payload: tuple, answer: str) -> bool:
    return answer in (alternate_case(payload[0], True), alternate_case(payload[0], False))


GRADERS: dict[str, Callable[[tuple, str], bool]] = {
    "sort": _sort, "upper": _upper, "repeat": _repeat, "altcase": _altcase,
}


def grade(problem: Problem, answer: str) -> bool:
    """True if `answer` (the decoded text before the first EOS) is a valid answer to `problem`."""
    try:
        grader = GRADERS[problem.task]
    except KeyError:
        raise ValueError(f"no grader for task {problem.task!r}") from None
    return grader(problem.payload, answer)
