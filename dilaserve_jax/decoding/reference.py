"""Reference sampler (LLaDA-style blocks; Dream's shifted logits when the model has them): no
cache, one full forward per step, host-side commit rule.

Deliberately plain: it is the exact baseline the fast decoding path is tested against.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from dilaserve_jax.models.config import ModelConfig
from dilaserve_jax.models.llada import canvas_positions, forward


@dataclass
class GenerationResult:
    answer: list[int]  # committed answer tokens before the first EOS
    canvas: np.ndarray  # final canvas (prompt + answer area, everything after the first EOS set to EOS)
    steps: int
    committed_per_step: list[int] = field(default_factory=list)
    seconds: float = 0.0


@partial(jax.jit, static_argnums=0)
def _logits(graphdef, params, canvas):
    logits, _ = forward(graphdef, params, canvas[None, :], canvas_positions(1, canvas.shape[0]))
    return logits[0]


def propose(logits: np.ndarray, mask_id: int, temperature: float, rng: np.random.Generator | None):
    """Proposed token and its confidence (softmax probability) at every position.

    The mask token is never proposed. With temperature > 0 the proposal is Gumbel-max sampled
    from logits / temperature; confidence is always the plain softmax probability of the proposal.
    """
    logits = np.array(logits, dtype=np.float32)
    logits[:, mask_id] = -np.inf
    shifted = logits - logits.max(axis=-1, keepdims=True)
    probs = np.exp(shifted)
    probs /= probs.sum(axis=-1, keepdims=True)
    if temperature > 0:
        gumbel = -np.log(-np.log(rng.uniform(1e-20, 1.0, size=logits.shape)))
        proposals = np.argmax(logits / temperature + gumbel, axis=-1)
    else:
        proposals = np.argmax(logits, axis=-1)
    return proposals, np.take_along_axis(probs, proposals[:, None], axis=-1)[:, 0]


def commit_mask(masked: np.ndarray, confidence: np.ndarray, threshold: float) -> np.ndarray:
    """Positions to commit in a block: masked with confidence > threshold, plus the most confident one.

    Ties go to the lowest position (numpy argmax returns the first maximum).
    """
    conf = np.where(masked, confidence, -np.inf)
    commit = masked & (conf > threshold)
    commit[int(np.argmax(conf))] = True
    return commit


def is_finished(canvas: np.ndarray, prompt_len: int, mask_id: int, eos_id: int) -> bool:
    """Everything before the first committed EOS of the answer is committed (or no mask is left)."""
    answer = canvas[prompt_len:]
    eos = np.flatnonzero(answer == eos_id)
    end = int(eos[0]) if eos.size else answer.size
    return not np.any(answer[:end] == mask_id)


def finalize(canvas: np.ndarray, prompt_len: int, eos_id: int) -> list[int]:
    """Answer tokens before the first EOS; sets everything from that EOS on to EOS in place."""
    answer = canvas[prompt_len:]
    eos = np.flatnonzero(answer == eos_id)
    end = int(eos[0]) if eos.size else answer.size
    answer[end:] = eos_id
    return [int(t) for t in answer[:end]]


def generate(graphdef, params, cfg: ModelConfig, prompt: list[int], gen_length: int, block_length: int,
             threshold: float = 1.0, temperature: float = 0.0, seed: int = 0) -> GenerationResult:
    """Generate gen_length answer tokens after prompt, block by block, with the threshold commit rule."""
    if not prompt:
        raise ValueError("prompt must not be empty")
    if gen_length <= 0 or block_length <= 0:
        raise ValueError("gen_length and block_length must be positive")
    if len(prompt) + gen_length > cfg.max_len:
        raise ValueError(f"prompt ({len(prompt)}) + gen_length ({gen_length}) exceeds max_len {cfg.max_len}")
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    start = time.perf_counter()
    rng = np.random.default_rng(seed) if temperature > 0 else None
    p = len(prompt)
    canvas = np.array(list(prompt) + [cfg.mask_id] * gen_length, dtype=np.int32)
    committed_per_step: list[int] = []
    for block in range(math.ceil(gen_length / block_length)):
        lo, hi = p + block * block_length, min(p + (block + 1) * block_length, p + gen_length)
        while np.any(canvas[lo:hi] == cfg.mask_id) and not is_finished(canvas, p, cfg.mask_id, cfg.eos_id):
            logits = np.asarray(_logits(graphdef, params, jnp.asarray(canvas)))
            if cfg.logits_shift:  # Dream's sampler: position 0 keeps its row, position i > 0 takes row i - 1
                logits = np.concatenate([logits[:1], logits[:-1]])
            proposals, confidence = propose(logits[lo:hi], cfg.mask_id, temperature, rng)
            commit = commit_mask(canvas[lo:hi] == cfg.mask_id, confidence, threshold)
            canvas[lo:hi] = np.where(commit, proposals, canvas[lo:hi])
            committed_per_step.append(int(commit.sum()))
        if is_finished(canvas, p, cfg.mask_id, cfg.eos_id):
            break
    answer = finalize(canvas, p, cfg.eos_id)
    return GenerationResult(answer, canvas, len(committed_per_step), committed_per_step, time.perf_counter() - start)
