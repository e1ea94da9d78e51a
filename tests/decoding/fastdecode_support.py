"""Helpers shared by the fast-decoding tests."""
import jax.numpy as jnp
import numpy as np

from dilaserve_jax.core.kinds import StepKind
from dilaserve_jax.decoding.decoder import SlotDecoder
from dilaserve_jax.decoding.reference import commit_mask, is_finished, propose
from dilaserve_jax.models.llada import forward, shift_logits


def prompts(n: int, seed: int = 0, lo: int = 6, hi: int = 20) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 128, size=int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]


def run_to_end(decoder: SlotDecoder, slot_taus: dict[int, float], force_refresh: bool = False,
               refresh_group_first: bool = True, groups: list[list[int]] | None = None) -> dict[int, list[int]]:
    """Step the given admitted slots to completion together; returns each slot's commits per step.
    `groups`: step these sets of slots one after another in every round (default: all together)."""
    per_step: dict[int, list[int]] = {s: [] for s in slot_taus}
    live = set(slot_taus)
    while live:
        for members in groups or [list(slot_taus)]:
            live_here = live & set(members)
            need = sorted(s for s in live_here if force_refresh or decoder.needs_refresh(s))
            rest = sorted(live_here - set(need))
            for refresh, group in ((True, need), (False, rest)):
                if not group:
                    continue
                for out in decoder.step(StepKind.REFRESH if refresh else StepKind.REUSE, group, [slot_taus[s] for s in group]):
                    per_step[out.slot].append(out.n_committed)
                    if out.request_finished:
                        live.discard(out.slot)
    return per_step


def plain_cached(graphdef, params, cfg, prompt, gen, block, tau, mode):
    """Greedy threshold decoding with a block-wise cache refreshed once per block: what the dual and
    prefix caches mean. Each block starts with a full forward (the refresh), whose K/V become the
    cache; every later step of the block recomputes the block (dual) or the block and everything
    after it (prefix) against that cache, and nothing it computes is kept. With shifted logits
    (cfg.logits_shift = 1) position i is scored by row i - 1, so reuse steps also recompute the row
    before the block. Returns (final canvas, commits per step, number of reuse steps)."""
    shift = cfg.logits_shift
    p, total = len(prompt), len(prompt) + gen
    canvas = np.array(list(prompt) + [cfg.mask_id] * gen, np.int32)
    committed, reuses = [], 0
    for lo in range(p, total, block):
        hi = min(lo + block, total)
        cache = None
        while np.any(canvas[lo:hi] == cfg.mask_id) and not is_finished(canvas, p, cfg.mask_id, cfg.eos_id):
            if cache is None:  # refresh: every position, its K/V kept for the rest of the block
                logits, cache = forward(graphdef, params, jnp.asarray(canvas)[None], jnp.arange(total)[None])
                rows = np.asarray(shift_logits(logits, shift)[0])[lo:hi]
            else:
                reuses += 1
                q_lo, q_end = lo - shift, hi if mode == "dual" else total
                logits, _ = forward(graphdef, params, jnp.asarray(canvas[q_lo:q_end])[None],
                                    jnp.arange(q_lo, q_end)[None], cache)
                rows = np.asarray(logits[0])[:hi - lo]  # row j (position q_lo + j) scores position lo + j
            proposals, confidence = propose(rows, cfg.mask_id, 0.0, None)
            commit = commit_mask(canvas[lo:hi] == cfg.mask_id, confidence, tau)
            canvas[lo:hi] = np.where(commit, proposals, canvas[lo:hi])
            committed.append(int(commit.sum()))
        if is_finished(canvas, p, cfg.mask_id, cfg.eos_id):
            break
    return canvas, committed, reuses
