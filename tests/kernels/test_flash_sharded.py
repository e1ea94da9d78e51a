"""The Pallas kernel per shard under shard_map (8 fake CPU devices, interpret mode) against the XLA
reference, and its cross-platform lowering at TP 2 and 4.

Inputs are laid out on a TP-`tp` mesh with the sharding table's attention specs, as the model's
q/k/v are inside a tensor-parallel instance; `attention(..., impl="pallas")` must find that mesh
from the inputs and give the reference result with the output still split by heads.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dilaserve_jax.core.layouts import MeshSpecError
from dilaserve_jax.kernels import attention
from dilaserve_jax.kernels.partition import attention_partition_specs
from dilaserve_jax.kernels.reference import reference_attention
from dilaserve_jax.kernels.sharded import inputs_mesh, model_axis_size

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
HEADS_SPLIT = P(None, None, "model", None)

# (query heads, kv heads) per TP degree: MHA, GQA with kv heads split, GQA with fewer kv heads than
# TP (replicated; one kv head per shard), and 3 kv heads at TP 4/8 (replicated; a shard's query heads
# straddle two kv heads).
HEAD_CASES = {
    1: [(8, 8), (8, 2)],
    2: [(8, 8), (8, 2), (8, 1)],
    4: [(8, 8), (8, 4), (8, 2), (24, 3)],
    8: [(8, 8), (16, 8), (8, 2), (24, 3)],
}
CASES = [(tp, heads, kv) for tp, pairs in HEAD_CASES.items() for heads, kv in pairs]


def tp_mesh(tp: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:tp]), ("model",))


def laid_out_inputs(tp, heads, kv_heads, dtype, batch=2, n_q=5, n_keys=37, head_dim=8, valid=(37, 11), seed=0):
    """q/k/v/valid_len on a TP-`tp` mesh as the table lays them out; also the host copies."""
    rng = np.random.default_rng(seed)
    host = [jnp.asarray(rng.standard_normal(s), jnp.float32).astype(dtype) for s in
            ((batch, n_q, heads, head_dim), (batch, n_keys, kv_heads, head_dim), (batch, n_keys, kv_heads, head_dim))]
    host.append(jnp.asarray(valid, jnp.int32))
    mesh = tp_mesh(tp)
    heads_spec, kv_spec = attention_partition_specs(heads, kv_heads, tp)
    placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(host, (heads_spec, kv_spec, kv_spec, P()))]
    return placed, host


def check_sharded_case(tp, heads, kv_heads, dtype):
    placed, host = laid_out_inputs(tp, heads, kv_heads, dtype)
    out = jax.jit(lambda q, k, v, n: attention(q, k, v, n, impl="pallas", block_k=16))(*placed)
    expected = reference_attention(*host)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    if tp > 1:  # per shard in, per shard out: the result stays split by heads for attn_out
        assert out.sharding.is_equivalent_to(NamedSharding(tp_mesh(tp), HEADS_SPLIT), out.ndim)
        assert {s.data.shape[2] for s in out.addressable_shards} == {heads // tp}
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32), atol=tol, rtol=tol)


@pytest.mark.parametrize("tp,heads,kv_heads", CASES)
def test_sharded_kernel_matches_reference_float32(tp, heads, kv_heads):
    check_sharded_case(tp, heads, kv_heads, jnp.float32)


@pytest.mark.slow
@pytest.mark.parametrize("tp,heads,kv_heads", CASES)
def test_sharded_kernel_matches_reference_bfloat16(tp, heads, kv_heads):
    check_sharded_case(tp, heads, kv_heads, jnp.bfloat16)


def test_eager_call_on_sharded_arrays():
    placed, host = laid_out_inputs(4, 8, 2, jnp.float32)
    out = attention(*placed, impl="pallas", block_k=16)  # no jit around it: the mesh comes from the arrays
    np.testing.assert_allclose(out, reference_attention(*host), atol=1e-5, rtol=1e-5)


def test_inputs_mesh_and_axis_checks():
    assert inputs_mesh(jnp.zeros(3)) is None  # one device: no mesh, the plain kernel runs
    placed, _ = laid_out_inputs(2, 8, 2, jnp.float32)
    assert model_axis_size(inputs_mesh(*placed)) == 2
    two_axes = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    with pytest.raises(ValueError, match="only axis"):
        model_axis_size(two_axes)
    with pytest.raises(MeshSpecError, match="does not divide the 6 attention heads"):
        attention_partition_specs(6, 6, 4)


# Cross-platform lowering (see test_flash.py): the per-shard kernel inside shard_map must lower for
# Triton and Mosaic, and the kernel call itself must see only one shard's heads.
LOWERING_HEADS = [(32, 32), (8, 2)]  # LLaDA-8B's MHA, and GQA whose kv heads are replicated at TP 4
B, Q, L, D = 2, 32, 1024, 128


def _lower_sharded(platform: str, lowering: str, tp: int, heads: int, kv_heads: int) -> str:
    mesh = tp_mesh(tp)
    heads_spec, kv_spec = attention_partition_specs(heads, kv_heads, tp)
    q = jax.ShapeDtypeStruct((B, Q, heads, D), jnp.bfloat16, sharding=NamedSharding(mesh, heads_spec))
    kv = jax.ShapeDtypeStruct((B, L, kv_heads, D), jnp.bfloat16, sharding=NamedSharding(mesh, kv_spec))
    lengths = jax.ShapeDtypeStruct((B,), jnp.int32, sharding=NamedSharding(mesh, P()))
    fn = lambda q, k, v, n: attention(q, k, v, n, impl="pallas", lowering=lowering, interpret=False)  # noqa: E731
    return jax.jit(fn).trace(q, kv, kv, lengths).lower(lowering_platforms=(platform,)).as_text()


def kernel_operand_types(text: str, target: str) -> list[str]:
    """Operand tensor types of the custom call `target` in StableHLO text (one call expected)."""
    calls = [line for line in text.splitlines() if f"custom_call @{target}(" in line]
    assert len(calls) == 1, f"expected one {target} call, found {len(calls)}"
    signature = re.search(r":\s*\(([^()]*)\)\s*->", calls[0].rsplit("}", 1)[-1])
    return re.findall(r"tensor<[^>]*>", signature.group(1))


def _expected_per_shard(tp, heads, kv_heads):
    local_heads = heads // tp
    local_kv = kv_heads // tp if kv_heads >= tp else 1  # replicated K/V: the one kv head the shard reads
    return f"tensor<{B}x{Q}x{local_heads * D}xbf16>", f"tensor<{B}x{L}x{local_kv * D}xbf16>"


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("heads,kv_heads", LOWERING_HEADS)
def test_sharded_kernel_lowers_for_gpu_triton(tp, heads, kv_heads):
    pytest.importorskip("jax.experimental.pallas.triton")
    text = _lower_sharded("cuda", "triton", tp, heads, kv_heads)
    assert "sdy.manual_computation" in text and 'manual_axes={"model"}' in text
    valid, q, k, v = kernel_operand_types(text, "__gpu$xla.gpu.triton")
    assert (q, k) == _expected_per_shard(tp, heads, kv_heads) and v == k


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("heads,kv_heads", LOWERING_HEADS)
def test_sharded_kernel_lowers_for_tpu_mosaic(tp, heads, kv_heads, monkeypatch):
    tpu_info = pytest.importorskip("jax._src.pallas.mosaic.tpu_info")
    if not all(hasattr(tpu_info, n) for n in ("get_tpu_info", "_get_tpu_info_impl", "ChipVersion")):
        pytest.skip("this JAX has no patchable TPU chip info")
    v5e = tpu_info._get_tpu_info_impl(tpu_info.ChipVersion.TPU_V5E, 1)
    monkeypatch.setattr(tpu_info, "get_tpu_info", lambda: v5e)
    text = _lower_sharded("tpu", "mosaic", tp, heads, kv_heads)
    assert "sdy.manual_computation" in text and 'manual_axes={"model"}' in text
    valid, q, k, v = kernel_operand_types(text, "tpu_custom_call")
    assert (q, k) == _expected_per_shard(tp, heads, kv_heads) and v == k
