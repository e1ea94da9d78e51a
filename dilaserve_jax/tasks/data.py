"""Encoding problems as LLaDA-style training rows and batching them by answer area.

A row is prompt + answer + EOS padding up to the task's answer area (`gen_length`), right-padded
with pad_id to the batch's sequence length; `valid_len` (= prompt + answer area) makes the model
ignore the padding keys. Tasks sharing an answer area form a group with one fixed sequence length,
so the jitted train step compiles once per group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from dilaserve_jax.models.tokenizer import CharTokenizer
from dilaserve_jax.tasks.suite import TASKS, Problem, training_examples

_TOK = CharTokenizer()


@dataclass(frozen=True, slots=True)
class Batch:
    tokens: np.ndarray  # [B, L] int32: clean prompt + answer + EOS padding, then pad_id
    answer_mask: np.ndarray  # [B, L] bool: the answer area (the positions that may be masked)
    valid_len: np.ndarray  # [B] int32: prompt + answer area

    @property
    def shape(self) -> tuple[int, int]:
        return self.tokens.shape


def encode_example(problem: Problem, answer: str) -> tuple[list[int], int, int]:
    """(token ids of prompt + answer area, prompt length, answer area length)."""
    gen = TASKS[problem.task].gen_length
    prompt, ans = _TOK.encode(problem.prompt), _TOK.encode(answer)
    if len(ans) > gen:
        raise ValueError(f"answer of {len(ans)} tokens exceeds the {problem.task} answer area {gen}")
    return prompt + ans + [_TOK.eos_id] * (gen - len(ans)), len(prompt), gen


def collate(examples: list[tuple[Problem, str]], seq_len: int) -> Batch:
    rows = len(examples)
    tokens = np.full((rows, seq_len), _TOK.pad_id, np.int32)
    answer_mask = np.zeros((rows, seq_len), bool)
    valid_len = np.zeros((rows,), np.int32)
    for i, (problem, answer) in enumerate(examples):
        ids, p, gen = encode_example(problem, answer)
        if len(ids) > seq_len:
            raise ValueError(f"{problem.task} example of {len(ids)} tokens exceeds seq_len {seq_len}")
        tokens[i, :len(ids)] = ids
        answer_mask[i, p:p + gen] = True
        valid_len[i] = len(ids)
    return Batch(tokens, answer_mask, valid_len)


def group_seq_len(gen_length: int) -> int:
    """Fixed sequence length of a group: longest prompt + answer area, rounded up to 8."""
    longest = max(t.max_prompt + t.gen_length for t in TASKS.values() if t.gen_length == gen_length)
    return -(-longest // 8) * 8


def batches(seed: int, batch_tokens: int, weights: dict[str, float]) -> Iterator[Batch]:
    """Endless training batches of about batch_tokens tokens each, one answer-area group per batch.

    A group is chosen with probability proportional to its tasks' total weight, so weights are
    the fraction of training *examples* per task; long-answer groups get fewer rows per batch.
    """
    names = [n for n, w in weights.items() if w > 0]
    if not names:
        raise ValueError("at least one task needs a positive weight")
    groups: dict[int, list[str]] = {}
    for n in names:
        groups.setdefault(TASKS[n].gen_length, []).append(n)
    keys = sorted(groups)
    group_w = np.array([sum(weights[n] for n in groups[g]) for g in keys])
    streams = {g: training_examples(seed + 1000 * i, tuple(groups[g]), tuple(weights[n] for n in groups[g]))
               for i, g in enumerate(keys)}
    rng = np.random.default_rng([seed, 31337])
    while True:
        g = keys[int(rng.choice(len(keys), p=group_w / group_w.sum()))]
        seq_len = group_seq_len(g)
        rows = max(1, batch_tokens // seq_len)
        yield collate([next(streams[g]) for _ in range(rows)], seq_len)
