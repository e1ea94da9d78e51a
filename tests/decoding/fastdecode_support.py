"""Helpers shared by the fast-decoding tests."""
import numpy as np

from dilaserve_jax.decoding.decoder import SlotDecoder


def prompts(n: int, seed: int = 0, lo: int = 6, hi: int = 20) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 128, size=int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]


def run_to_end(decoder: SlotDecoder, slot_taus: dict[int, float], force_refresh: bool = False,
               refresh_group_first: bool = True) -> dict[int, list[int]]:
    """Step the given admitted slots to completion together; returns each slot's commits per step."""
    per_step: dict[int, list[int]] = {s: [] for s in slot_taus}
    live = set(slot_taus)
    while live:
        need = sorted(s for s in live if force_refresh or decoder.needs_refresh(s))
        rest = sorted(live - set(need))
        for refresh, group in ((True, need), (False, rest)):
            if not group:
                continue
            for out in decoder.step(refresh, group, [slot_taus[s] for s in group]):
                per_step[out.slot].append(out.n_committed)
                if out.request_finished:
                    live.discard(out.slot)
    return per_step
