"""The scheduler's plan owns each slot's block and step kind; the decoder follows it.

Offline callers pass no blocks and the decoder keeps track itself; a serving plan passes them and
the decoder steps exactly the block it is told, in every cache mode and batch layout."""
import pytest

from dilaserve_jax.core.kinds import StepKind
from fastdecode_support import prompts

GEN, BLOCK = 32, 16


def _run(dec, slots, tau, follow_plan: bool):
    """Step `slots` to the end, refreshing at each block start; with `follow_plan`, pass the blocks
    as a scheduler tracks them (advanced on each outcome's block_finished)."""
    blocks = {s: 0 for s in slots}
    fresh = {s: True for s in slots}
    live = list(slots)
    while live:
        for kind, group in ((StepKind.REFRESH, [s for s in live if fresh[s]]),
                            (StepKind.REUSE, [s for s in live if not fresh[s]])):
            if not group:
                continue
            plan = [blocks[s] for s in group] if follow_plan else None
            for out in dec.step(kind, group, [tau] * len(group), plan):
                fresh[out.slot] = out.block_finished
                blocks[out.slot] += out.block_finished
                if out.request_finished:
                    live.remove(out.slot)
    return {s: dec.answer(s) for s in slots}


@pytest.mark.parametrize("mode", ["dual", "prefix", "none"])
def test_following_the_plan_decodes_what_the_decoder_decodes_alone(make_decoder, mode):
    want_dec, got_dec = make_decoder(mode), make_decoder(mode)
    for dec in (want_dec, got_dec):
        for s, p in enumerate(prompts(3, seed=7, lo=4, hi=20)):
            dec.admit(s, p, GEN, BLOCK)
    assert _run(got_dec, [0, 1, 2], 0.7, follow_plan=True) == _run(want_dec, [0, 1, 2], 0.7, follow_plan=False)


def test_the_plan_decides_the_block(make_decoder):
    """Told block 1 at the first step, the decoder commits there, not in block 0."""
    dec = make_decoder("dual")
    prompt = prompts(1, seed=3)[0]
    dec.admit(0, prompt, GEN, BLOCK)
    out = dec.step(StepKind.REFRESH, [0], [1.0], [1])[0]
    assert out.positions and all(BLOCK <= p < 2 * BLOCK for p in out.positions)
    with pytest.raises(ValueError, match="outside its answer"):
        dec.step(StepKind.REUSE, [0], [1.0], [2])


def test_without_a_plan_a_stale_reuse_is_refused(make_decoder):
    dec = make_decoder("dual")
    dec.admit(0, prompts(1, seed=5)[0], GEN, BLOCK)
    with pytest.raises(ValueError, match="needs a refresh"):
        dec.step(StepKind.REUSE, [0], [1.0])
    with pytest.raises(TypeError, match="StepKind"):
        dec.step(True, [0], [1.0])
