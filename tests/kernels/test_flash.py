"""The Pallas flash kernel against the XLA reference, in interpret mode on CPU (compiled on GPU/TPU).

Tolerances: float32 at atol = rtol = 1e-5 (the kernel divides by the softmax sum once at the end
instead of normalising probabilities first, so results differ from the reference by a few float32
ulps, ~1e-6 here); bf16 at 1e-2 (the kernel feeds bf16 probabilities to the P.V product, as flash
attention does; the reference keeps them in float32).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dilaserve_jax.kernels import attention, describe_attention, resolve_attention
from dilaserve_jax.kernels import flash
from dilaserve_jax.kernels.flash import flash_attention
from dilaserve_jax.kernels.reference import reference_attention

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    n_q: int
    n_keys: int
    kv_heads: int
    group: int
    head_dim: int
    valid_len: tuple[int, ...]
    block_q: int | None
    block_k: int | None
    lowering: str


@st.composite
def cases(draw):
    batch = draw(st.integers(1, 3))
    n_keys = draw(st.integers(1, 80))
    # Each row's valid length: the edges (1 and L) are drawn as often as the interior.
    valid = st.one_of(st.just(1), st.just(n_keys), st.integers(1, n_keys))
    return Case(
        batch=batch,
        n_q=draw(st.one_of(st.just(1), st.integers(1, 40))),
        n_keys=n_keys,
        kv_heads=draw(st.integers(1, 2)),
        group=draw(st.integers(1, 3)),
        head_dim=draw(st.sampled_from([4, 8, 16, 24, 32])),
        valid_len=tuple(draw(valid) for _ in range(batch)),
        block_q=draw(st.sampled_from([None, 1, 3, 8, 16, 32])),
        block_k=draw(st.sampled_from([None, 1, 5, 16, 32, 128])),
        lowering=draw(st.sampled_from(flash.LOWERINGS)),
    )


def make_inputs(case: Case, dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    heads = case.kv_heads * case.group
    q = rng.standard_normal((case.batch, case.n_q, heads, case.head_dim))
    k = rng.standard_normal((case.batch, case.n_keys, case.kv_heads, case.head_dim))
    v = rng.standard_normal((case.batch, case.n_keys, case.kv_heads, case.head_dim))
    as_array = lambda x: jnp.asarray(x, jnp.float32).astype(dtype)  # noqa: E731
    return as_array(q), as_array(k), as_array(v), jnp.asarray(case.valid_len, jnp.int32)


def check_against_reference(case: Case, dtype, **kernel_options):
    q, k, v, valid_len = make_inputs(case, dtype)
    out = flash_attention(q, k, v, valid_len, block_q=case.block_q, block_k=case.block_k,
                          lowering=case.lowering, **kernel_options)
    expected = reference_attention(q, k, v, valid_len)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    out, expected = np.asarray(out, np.float32), np.asarray(expected, np.float32)
    assert not np.isnan(out).any(), "NaN in kernel output (an unwritten or 0/0 row)"
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(out, expected, atol=tol, rtol=tol)
    return out


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_float32_matches_reference(case):
    check_against_reference(case, jnp.float32, debug_poison_output=True)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_bfloat16_matches_reference(case):
    check_against_reference(case, jnp.bfloat16, debug_poison_output=True)


@pytest.mark.parametrize("lowering", flash.LOWERINGS)
def test_unpoisoned_production_path_and_edge_lengths(lowering):
    # Q = 1, valid length 1, a full row, and a row past L (clamped to L), several K tiles.
    case = Case(batch=4, n_q=1, n_keys=37, kv_heads=2, group=2, head_dim=16,
                valid_len=(1, 37, 20, 99), block_q=None, block_k=16, lowering=lowering)
    check_against_reference(case, jnp.float32)


@pytest.mark.parametrize("lowering", flash.LOWERINGS)
def test_valid_len_zero_gives_zeros_not_nan(lowering):
    # block_k 16: the smallest key tile compiled Triton takes, so this also runs on a GPU (2 key tiles).
    case = Case(batch=2, n_q=5, n_keys=24, kv_heads=1, group=2, head_dim=8,
                valid_len=(0, 24), block_q=None, block_k=16, lowering=lowering)
    out = check_against_reference(case, jnp.float32, debug_poison_output=True)
    assert np.all(out[0] == 0.0)
    assert np.abs(out[1]).max() > 0.1  # the live row is real attention, not zeros


def test_poisoned_output_exposes_unwritten_rows(monkeypatch):
    # Drop the last query tile from the grid: its rows must come back NaN, proving the poison works.
    real_grid = flash._query_tiles_grid
    monkeypatch.setattr(flash, "_query_tiles_grid", lambda b, h, n: real_grid(b, h, n - 1))
    jax.clear_caches()  # the jitted kernel must be retraced with the shortened grid
    case = Case(batch=1, n_q=24, n_keys=16, kv_heads=1, group=1, head_dim=8,
                valid_len=(16,), block_q=8, block_k=8, lowering="triton")
    q, k, v, valid_len = make_inputs(case, jnp.float32)
    out = np.asarray(flash_attention(q, k, v, valid_len, block_q=8, block_k=8, debug_poison_output=True))
    jax.clear_caches()
    assert np.isnan(out[:, 16:]).all()
    assert not np.isnan(out[:, :16]).any()


def test_kernel_under_jit_with_traced_lengths():
    case = Case(batch=2, n_q=8, n_keys=40, kv_heads=2, group=1, head_dim=8,
                valid_len=(3, 40), block_q=None, block_k=16, lowering="triton")
    q, k, v, valid_len = make_inputs(case, jnp.float32)
    run = jax.jit(lambda q, k, v, n: attention(q, k, v, n, impl="pallas", block_k=16))
    for lengths in ((3, 40), (17, 1)):
        n = jnp.asarray(lengths, jnp.int32)
        np.testing.assert_allclose(run(q, k, v, n), reference_attention(q, k, v, n), atol=1e-5, rtol=1e-5)


def test_selection():
    assert resolve_attention("xla") == "xla" and resolve_attention("pallas") == "pallas"
    expected_auto = "xla" if jax.default_backend() == "cpu" else "pallas"
    assert resolve_attention("auto") == expected_auto
    assert expected_auto in describe_attention("auto")
    with pytest.raises(ValueError):
        resolve_attention("flash")


def test_misaligned_tiles_rejected_when_compiling():
    q = jnp.zeros((1, 64, 2, 32))
    k = jnp.zeros((1, 64, 2, 32))
    with pytest.raises(ValueError, match="powers of two"):
        flash_attention(q, k, k, jnp.array([64]), block_q=24, lowering="triton", interpret=False)
    with pytest.raises(ValueError, match="multiple of 128"):
        flash_attention(q, jnp.zeros((1, 512, 2, 32)), jnp.zeros((1, 512, 2, 32)), jnp.array([64]),
                        block_k=200, lowering="mosaic", interpret=False)


LOWERING_SHAPES = [(2, 32, 1024, 32, 32, 128), (3, 1, 37, 4, 2, 16)]  # (B, Q, L, H, KVH, D)


def _lower_for(platform: str, lowering: str, dtype, shape) -> str:
    batch, n_q, n_keys, heads, kv_heads, head_dim = shape
    q = jax.ShapeDtypeStruct((batch, n_q, heads, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((batch, n_keys, kv_heads, head_dim), dtype)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    fn = functools.partial(flash_attention, lowering=lowering, interpret=False)
    return jax.jit(fn).trace(q, kv, kv, lengths).lower(lowering_platforms=(platform,)).as_text()


# Cross-platform lowering runs the Pallas->Triton and Pallas->Mosaic lowerings on CPU, so a kernel
# construct either backend rejects fails here, without an accelerator (the final compile is not run).
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", LOWERING_SHAPES)
def test_kernel_lowers_for_gpu_triton(shape, dtype):
    pytest.importorskip("jax.experimental.pallas.triton")
    assert "triton" in _lower_for("cuda", "triton", dtype, shape)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", LOWERING_SHAPES)
def test_kernel_lowers_for_tpu_mosaic(shape, dtype, monkeypatch):
    # Mosaic lowering asks the (absent) TPU for its generation; pretend to be a v5e.
    tpu_info = pytest.importorskip("jax._src.pallas.mosaic.tpu_info")
    if not all(hasattr(tpu_info, n) for n in ("get_tpu_info", "_get_tpu_info_impl", "ChipVersion")):
        pytest.skip("this JAX has no patchable TPU chip info")
    v5e = tpu_info._get_tpu_info_impl(tpu_info.ChipVersion.TPU_V5E, 1)
    monkeypatch.setattr(tpu_info, "get_tpu_info", lambda: v5e)
    assert "tpu_custom_call" in _lower_for("tpu", "mosaic", dtype, shape)


ACCELERATOR_CASES = [
    Case(batch=2, n_q=32, n_keys=1024, kv_heads=4, group=2, head_dim=128,
         valid_len=(1000, 1), block_q=None, block_k=None, lowering="triton"),
    Case(batch=3, n_q=200, n_keys=300, kv_heads=2, group=1, head_dim=64,
         valid_len=(300, 0, 129), block_q=None, block_k=None, lowering="triton"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", ACCELERATOR_CASES)
def test_compiled_triton_kernel_matches_reference(case, dtype):
    check_against_reference(case, dtype, interpret=False, debug_poison_output=True)


@pytest.mark.tpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", ACCELERATOR_CASES)
def test_compiled_mosaic_kernel_matches_reference(case, dtype):
    check_against_reference(dataclasses.replace(case, lowering="mosaic"), dtype, interpret=False,
                            debug_poison_output=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reference_multiplies_float32_at_full_precision(dtype):
    # GPU XLA runs default-precision float32 products in TF32; the reference, like the kernel, asks
    # for exact ones (bf16 inputs keep the default, which is exact for them).
    case = Case(batch=1, n_q=4, n_keys=8, kv_heads=1, group=2, head_dim=8, valid_len=(8,), block_q=None,
                block_k=None, lowering="triton")
    text = jax.jit(reference_attention).lower(*make_inputs(case, dtype)).as_text()
    assert text.count("HIGHEST") == (4 if dtype == jnp.float32 else 0)  # two products, two operands each
