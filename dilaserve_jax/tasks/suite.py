"""The synthetic task suite of the embedded tiny model: character-level prompt -> answer problems.

Two kinds of task:
- deterministic: exactly one correct answer (`sort`, `upper`);
- multi-answer: several valid answers; training draws one uniformly and the grader accepts any.
  In `repeat` (either of two letters, written n times) and `altcase` (a phrase with its characters
  alternately in upper and lower case, starting with either) every letter position is one of two values with probability
  1/2, and a valid answer needs all of them to agree. Decoding one position at a time, each
  committed letter settles the rest; committing many positions in one step at a low threshold
  takes each position's own most likely value, which mixes the two answers into an invalid one.

The tasks are chosen to be learnable by a 4-layer model in minutes of CPU training. The phrase
tasks write their phrase into a fixed-width field, so every answer character sits at a constant
distance from its source. The multi-answer tasks need only agreement with a committed neighbour
(the same letter in `repeat`; in `altcase` the case at a fixed distance: opposite at an odd one, the same at an even one), which the model learns
about as fast as a copy. Tasks whose answer positions must instead be compared against the prompt
(letter counts in "any arrangement of these letters", word lookup in "any one of these words")
and string reversal were tried and dropped: the model learned each position's marginal but not
the dependence between positions within the training budget.

Problems are generated deterministically from (seed, task, split). The held-out split is a hash
partition of each problem's canonical form (the answer set it defines), so no held-out problem
is ever drawn for training, in any presentation order.
"""
from __future__ import annotations

import hashlib
import string
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

DETERMINISTIC, MULTI = "deterministic", "multi-answer"
SPLITS = ("train", "heldout")
HELDOUT_BUCKETS = 10  # one canonical form in ten is held out
LOWER = string.ascii_lowercase


@dataclass(frozen=True, slots=True)
class Problem:
    """One task instance. `payload` is the task input the grader checks an answer against."""

    task: str
    prompt: str
    payload: tuple

    @property
    def canonical(self) -> str:
        return TASKS[self.task].canonical(self.payload)


@dataclass(frozen=True, slots=True)
class Task:
    """A task: how to draw an input, show it, sample a valid answer, and its answer area."""

    name: str
    kind: str
    gen_length: int  # answer area in tokens; answers are padded with EOS up to it
    max_prompt: int  # longest prompt in characters (fixes the training sequence length)
    min_answer: int
    max_answer: int
    draw: Callable[[np.random.Generator], tuple]  # random payload
    prompt_of: Callable[[tuple], str]
    canonical: Callable[[tuple], str]  # equal for payloads with the same answer set
    answer: Callable[[tuple, np.random.Generator], str]  # one valid answer, uniform among them

    def __post_init__(self):
        if self.kind not in (DETERMINISTIC, MULTI):
            raise ValueError(f"task kind must be {DETERMINISTIC!r} or {MULTI!r}, got {self.kind!r}")
        if not 0 < self.min_answer <= self.max_answer <= self.gen_length:
            raise ValueError(f"task {self.name}: need 0 < min_answer <= max_answer <= gen_length")


def _letters(rng: np.random.Generator, lo: int, hi: int, alphabet: str = LOWER) -> str:
    n = int(rng.integers(lo, hi + 1))
    return "".join(alphabet[i] for i in rng.integers(0, len(alphabet), n))


# --- deterministic tasks -------------------------------------------------------------------------

def _draw_sort(rng):
    return (_letters(rng, 3, 6, string.digits),)


SHORT_AREA = 12  # answer area of the short tasks (one block)
UPPER_FIELD = 90  # the phrase is written into a field this wide, padded with FIELD_PAD
FIELD_PAD = "."


def _draw_upper(rng):
    # A phrase of random lowercase words, 24-90 characters: answers span one to three blocks.
    target = int(rng.integers(24, UPPER_FIELD + 1))
    phrase = _letters(rng, 2, 8)
    while len(phrase) < target:
        phrase += " " + _letters(rng, 2, 8)
    return (phrase[:UPPER_FIELD].rstrip(),)


def field_prompt(task_name: str, phrase: str) -> str:
    """A phrase task's prompt (`upper`, `altcase`): the phrase left-aligned in a fixed-width field, then '='."""
    if len(phrase) > UPPER_FIELD or FIELD_PAD in phrase:
        raise ValueError(f"{task_name} takes a phrase of at most {UPPER_FIELD} characters without {FIELD_PAD!r}")
    return f"{task_name} {phrase.ljust(UPPER_FIELD, FIELD_PAD)}="


# --- multi-answer tasks --------------------------------------------------------------------------

def _draw_repeat(rng):
    # Two distinct letters and a count: each position is either letter with probability 1/2.
    a, b = (LOWER[i] for i in rng.choice(len(LOWER), size=2, replace=False))
    return (a + b, int(rng.integers(2, 7)))


def _one_letter_repeated(payload, rng):
    letters, n = payload
    return letters[int(rng.integers(0, len(letters)))] * n


def alternate_case(phrase: str, upper_first: bool) -> str:
    """The phrase with character i in upper case iff i is even (upper_first) or odd (not upper_first)."""
    return "".join(c.upper() if (i % 2 == 0) == upper_first else c for i, c in enumerate(phrase))


def _either_alternation(payload, rng):
    return alternate_case(payload[0], bool(rng.integers(0, 2)))


TASK_LIST = (
    Task("sort", DETERMINISTIC, SHORT_AREA, 12, 3, 6, _draw_sort, lambda p: f"sort {p[0]}=",
         lambda p: p[0], lambda p, rng: "".join(sorted(p[0]))),
    Task("upper", DETERMINISTIC, 96, 7 + UPPER_FIELD, 24, UPPER_FIELD, _draw_upper,
         lambda p: field_prompt("upper", p[0]), lambda p: p[0], lambda p, rng: p[0].upper()),
    Task("repeat", MULTI, SHORT_AREA, 12, 2, 6, _draw_repeat, lambda p: f"repeat {p[1]} {p[0]}=",
         lambda p: f"{p[1]} {''.join(sorted(p[0]))}", _one_letter_repeated),
    Task("altcase", MULTI, 96, 9 + UPPER_FIELD, 24, UPPER_FIELD, _draw_upper,
         lambda p: field_prompt("altcase", p[0]), lambda p: p[0], _either_alternation),
)
TASKS = {t.name: t for t in TASK_LIST}


def task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; tasks: {', '.join(TASKS)}") from None


MAX_BLOCK = 32


def task_block(answer_length: int) -> int:
    """Block length for a task's answer area: one block up to 32 tokens, else 32-token blocks."""
    block = min(answer_length, MAX_BLOCK)
    if answer_length % block:
        raise ValueError(f"answer area {answer_length} is not a whole number of {block}-token blocks")
    return block


def split_of(task_name: str, canonical: str) -> str:
    """'heldout' for one canonical form in HELDOUT_BUCKETS (a stable hash, not Python's hash())."""
    digest = hashlib.sha256(f"{task_name}\x00{canonical}".encode()).digest()
    return "heldout" if int.from_bytes(digest[:8], "little") % HELDOUT_BUCKETS == 0 else "train"


def _rng(seed: int, task_name: str, split: str) -> np.random.Generator:
    return np.random.default_rng([seed, TASK_LIST.index(TASKS[task_name]), SPLITS.index(split)])


def draw_problem(t: Task, split: str, rng: np.random.Generator) -> Problem:
    """Rejection-sample a problem of `split` (about one draw in ten is held out)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    while True:
        payload = t.draw(rng)
        if split_of(t.name, t.canonical(payload)) == split:
            return Problem(t.name, t.prompt_of(payload), payload)


def problems(task_name: str, split: str, n: int, seed: int = 0) -> list[Problem]:
    """The first n problems of a task's split for a seed (deterministic; repeats possible)."""
    t, rng = task(task_name), _rng(seed, task_name, split)
    return [draw_problem(t, split, rng) for _ in range(n)]


def unique_problems(task_name: str, split: str, n: int, seed: int = 0) -> list[Problem]:
    """n distinct problems (by canonical form), deterministic per seed: the evaluation sample."""
    t, rng = task(task_name), _rng(seed, task_name, split)
    seen, out = set(), []
    for _ in range(200 * n):
        p = draw_problem(t, split, rng)
        if p.canonical not in seen:
            seen.add(p.canonical)
            out.append(p)
            if len(out) == n:
                return out
    raise ValueError(f"task {task_name} has fewer than {n} distinct {split} problems")


def training_examples(seed: int, tasks: tuple[str, ...] | None = None,
                      weights: tuple[float, ...] | None = None) -> Iterator[tuple[Problem, str]]:
    """Endless (problem, sampled answer) pairs from the training split, tasks mixed by weight."""
    names = tuple(tasks or TASKS)
    w = np.asarray(weights if weights is not None else [1.0] * len(names), dtype=np.float64)
    if w.shape != (len(names),) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError("weights must be non-negative, one per task, not all zero")
    rng = np.random.default_rng([seed, 7919])
    while True:
        t = TASKS[names[int(rng.choice(len(names), p=w / w.sum()))]]
        p = draw_problem(t, "train", rng)
        yield p, t.answer(p.payload, rng)
