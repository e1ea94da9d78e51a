"""The per-step confidence histogram (the threshold controller's risk evidence)."""
import jax.numpy as jnp
import numpy as np

from dilaserve_jax.core.kinds import StepKind
from dilaserve_jax.decoding.commit import CONFIDENCE_BINS, confidence_histogram
from fastdecode_support import prompts

GEN, BLOCK = 40, 16


def test_histogram_counts_masked_positions_per_bin():
    assert CONFIDENCE_BINS == 20  # edges on multiples of 0.05: the τ grid's points
    conf = jnp.array([[0.07, 0.56, 0.57, 0.999, 1.0, 0.3], [0.0, 0.1, 0.2, 0.97, 0.97, 0.97]], jnp.float32)
    masked = jnp.array([[True, True, True, True, True, False], [False, False, False, True, True, False]])
    got = np.asarray(confidence_histogram(masked, conf))
    want = np.zeros((2, CONFIDENCE_BINS), np.int32)
    want[0, 1], want[0, 11], want[0, 19] = 1, 2, 2  # 0.999 and exactly 1.0 both in the last bin
    want[1, 19] = 2  # unmasked positions are not counted
    np.testing.assert_array_equal(got, want)


def test_step_reports_the_block_masked_positions_before_commit(make_decoder):
    dec = make_decoder("dual")
    dec.admit(0, prompts(1, seed=3)[0], GEN, BLOCK)
    start, masked = 0, BLOCK
    for _ in range(GEN):
        out = dec.step(StepKind.REFRESH if dec.needs_refresh(0) else StepKind.REUSE, [0], [0.9])[0]
        assert len(out.confidence_counts) == CONFIDENCE_BINS
        assert sum(out.confidence_counts) == masked  # every masked position of the block, counted once
        masked -= out.n_committed
        if out.block_finished:
            start += BLOCK
            masked = min(BLOCK, GEN - start)
        if out.request_finished:
            break
    assert out.request_finished
