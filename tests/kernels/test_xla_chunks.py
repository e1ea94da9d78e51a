"""XLA attention taken a few batch rows at a time (kernels.xla_attention) equals the reference: rows
never interact, so chunking only bounds how many scores exist at once. With one kv head per query
head it is bit for bit here; with grouped heads XLA may pick another dot strategy for another row
count, a few float32 ulps apart (as between batch buckets)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dilaserve_jax import kernels
from dilaserve_jax.kernels import rows_per_chunk, xla_attention
from dilaserve_jax.kernels.reference import reference_attention


def test_rows_per_chunk_divides_the_batch_within_the_budget():
    assert rows_per_chunk(32, 160, 8, 160) == 4  # a batch-32 refresh of the benchmark: 819 KB of scores per row
    assert rows_per_chunk(32, 32, 8, 160) == 16  # its reuse step: 164 KB per row, 25 fit, 16 divides 32
    assert rows_per_chunk(8, 32, 8, 160) == 8  # small enough: one call
    assert rows_per_chunk(6, 10, 2, 10, budget=4 * 2 * 10 * 10 * 4) == 3  # 4 fit, 3 divides 6
    assert rows_per_chunk(5, 10, 2, 10, budget=1) == 1


@pytest.mark.parametrize("batch,group", [(6, 1), (8, 2), (5, 1)])
def test_chunks_equal_the_reference_exactly(monkeypatch, batch, group):
    monkeypatch.setattr(kernels, "SCORE_CHUNK_BYTES", 4 * 2 * group * 12 * 20 * 2)  # two rows' scores
    rng = np.random.default_rng(batch)
    q = jnp.asarray(rng.standard_normal((batch, 12, 2 * group, 8), np.float32))
    k = jnp.asarray(rng.standard_normal((batch, 20, 2, 8), np.float32))
    v = jnp.asarray(rng.standard_normal((batch, 20, 2, 8), np.float32))
    valid_len = jnp.asarray(rng.integers(0, 21, batch), jnp.int32)
    assert "while" in jax.jit(xla_attention).lower(q, k, v, valid_len).as_text()  # it did chunk
    got = np.asarray(jax.jit(xla_attention)(q, k, v, valid_len))
    want = np.asarray(jax.jit(reference_attention)(q, k, v, valid_len))
    if group == 1:
        np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-5)
