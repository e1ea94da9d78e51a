"""Flash attention in Pallas for cached bidirectional attention with per-row valid lengths.

One kernel body, two lowerings:

* "triton" (GPU): valid_len arrives as a tiny blocked input; tiles are powers of two >= 16 because
  Triton tensors must have power-of-two shapes and `tl.dot` needs every dimension >= 16.
* "mosaic" (TPU): valid_len arrives by scalar prefetch into SMEM; query tiles are multiples of 16
  rows and key tiles multiples of 128 (the (8, 128) vreg tiling, 16 rows for packed bf16), and the
  head dim is padded to a multiple of 128 so a head's slice of `[B, L, KVH*D]` is a legal block.

On CPU the same kernel runs with `interpret=True` (tests use either lowering's layout there).

Layout: q `[B, Q, H, D]` and k/v `[B, L, KVH, D]` are viewed as `[B, Q, H*D]` / `[B, L, KVH*D]`
(free reshapes, no transpose copies of the KV cache). The grid is (batch, query head, query tile);
query head h reads kv head h // group, and since the query-tile axis is innermost a K/V block stays
resident across a head's query tiles (TPU skips the refetch; on GPU the group's heads share L2).
Each program keeps one query tile and walks K/V tiles with an online softmax, so no [Q, L] score
matrix exists in memory. Only ceil(valid_len / block_k) tiles are visited: padding and unused
slots cost nothing, and a row with valid_len 0 gives zeros.

TPU note: a whole K/V row `[L, D]` of one kv head is a VMEM block (double-buffered), i.e.
4 * L * D * itemsize bytes for K and V; L = 4096, D = 128, bf16 is 4 MiB, within default limits.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from dilaserve_jax.kernels.reference import products_precision

LOWERINGS = ("triton", "mosaic")

# Finite "minus infinity": exp(MASK - m) underflows to 0 and MASK - MASK stays 0, never NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True, slots=True)
class TileSizes:
    """Query rows and keys per tile; num_warps/num_stages are Triton-only launch parameters."""

    block_q: int
    block_k: int
    num_warps: int | None = None
    num_stages: int | None = None

    def __post_init__(self):
        if self.block_q < 1 or self.block_k < 1:
            raise ValueError(f"tile sizes must be positive, got {self}")


# Per-backend defaults. GPU: 64x64 tiles with 4 warps keep the f32 accumulator and scores in
# registers for head_dim 128. TPU: 512-key tiles amortise per-step overhead on the MXU.
# Interpret mode: big tiles, because interpret cost grows with the number of tile steps.
DEFAULT_TILES = {
    "triton": TileSizes(block_q=64, block_k=64, num_warps=4, num_stages=2),
    "mosaic": TileSizes(block_q=128, block_k=512),
    "interpret": TileSizes(block_q=64, block_k=128),
}


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def default_lowering() -> str:
    """Mosaic on TPU; Triton rules everywhere else (GPU, and CPU interpret mode)."""
    return "mosaic" if jax.default_backend() == "tpu" else "triton"


def default_interpret() -> bool:
    return jax.default_backend() == "cpu"


def _padded_head_dim(d: int, lowering: str) -> int:
    return max(16, _next_pow2(d)) if lowering == "triton" else _round_up(d, 128)


def _fit_tiles(tiles: TileSizes, n_rows: int, n_keys: int, lowering: str, interpret: bool) -> TileSizes:
    """Shrink tiles to the problem (a 32-row query block needs no 64-row tile), keeping alignment."""
    if lowering == "triton":
        block_q = min(tiles.block_q, _next_pow2(max(n_rows, 16)))
        block_k = min(tiles.block_k, _next_pow2(max(n_keys, 16)))
        aligned = all(b >= 16 and b == _next_pow2(b) for b in (block_q, block_k))
        rule = "powers of two >= 16"
    else:
        block_q = min(tiles.block_q, _round_up(n_rows, 16))
        block_k = min(tiles.block_k, _round_up(n_keys, 128))
        aligned = block_q % 16 == 0 and block_k % 128 == 0
        rule = "block_q a multiple of 16 and block_k a multiple of 128"
    if not interpret and not aligned:
        raise ValueError(f"{lowering} tiles must be {rule}; got block_q={block_q}, block_k={block_k}")
    return dataclasses.replace(tiles, block_q=block_q, block_k=block_k)


def _flash_kernel(valid_ref, q_ref, k_ref, v_ref, *rest, scale, block_k, valid_from_smem, precision):
    """One (batch, head, query tile): online softmax over the K/V tiles below valid_len."""
    o_ref = rest[-1]  # rest = (o_ref,) or (poison_ref, o_ref) when the output is aliased
    # SMEM (TPU scalar prefetch) holds all of valid_len; the blocked GPU input holds this row's.
    valid = valid_ref[pl.program_id(0)] if valid_from_smem else valid_ref[0]
    q = q_ref[...]
    block_q, head_dim = q.shape

    def visit_kv_tile(tile, carry):
        acc, row_max, row_sum = carry
        start = pl.multiple_of(tile * block_k, block_k)
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[pl.ds(start, block_k), :]
        scores = lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=precision
        ) * scale
        key_pos = start + lax.broadcasted_iota(jnp.int32, scores.shape, 1)
        scores = jnp.where(key_pos < valid, scores, MASK_VALUE)
        new_max = jnp.maximum(row_max, jnp.max(scores, axis=1, keepdims=True))
        rescale = jnp.exp(row_max - new_max)  # shrinks what was summed under the old max
        probs = jnp.exp(scores - new_max)
        row_sum = rescale * row_sum + jnp.sum(probs, axis=1, keepdims=True)
        pv = lax.dot_general(
            probs.astype(v.dtype), v, (((1,), (0,)), ((), ())),
            preferred_element_type=jnp.float32, precision=precision,
        )
        return rescale * acc + pv, new_max, row_sum

    init = (
        jnp.zeros((block_q, head_dim), jnp.float32),
        jnp.full((block_q, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((block_q, 1), jnp.float32),
    )
    # Tiles wholly past valid_len are skipped, so every visited tile has at least one real key.
    # lax.div (C division) rather than //: valid >= 0, and floor division's sign fix-up is extra
    # work that Mosaic lowers through chip-specific rules.
    n_tiles = lax.div(valid + (block_k - 1), block_k)
    acc, _, row_sum = lax.fori_loop(0, n_tiles, visit_kv_tile, init)
    # valid_len 0 visits nothing: row_sum is 0 and the row must be 0, not 0/0.
    inv_sum = jnp.where(row_sum > 0, 1.0 / jnp.where(row_sum > 0, row_sum, 1.0), 0.0)
    o_ref[...] = (acc * inv_sum).astype(o_ref.dtype)


def _query_tiles_grid(batch: int, heads: int, n_q_tiles: int) -> tuple[int, int, int]:
    # A separate function so a test can shrink the grid and check that poisoned rows show up.
    return (batch, heads, n_q_tiles)


def _compiler_params(lowering: str, tiles: TileSizes):
    if lowering == "mosaic":
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel"))
    try:
        from jax.experimental.pallas import triton as pltriton
    except ImportError:  # a JAX without the Triton backend: let Pallas pick its GPU defaults
        return None
    return pltriton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages)


@functools.partial(
    jax.jit, static_argnames=("block_q", "block_k", "lowering", "interpret", "debug_poison_output")
)
def flash_attention(
    q,
    k,
    v,
    valid_len,
    *,
    block_q: int | None = None,
    block_k: int | None = None,
    lowering: str | None = None,
    interpret: bool | None = None,
    debug_poison_output: bool = False,
):
    """Bidirectional GQA attention, same contract as `reference_attention`, as a Pallas kernel.

    q: [B, Q, H, D]; k, v: [B, L, KVH, D] with H % KVH == 0; valid_len: [B] int (keys at positions
    >= valid_len[b] are ignored; 0 gives zeros). Scores and softmax in float32, scale 1/sqrt(D),
    output in q's dtype.

    block_q / block_k: tile sizes (default per backend, see DEFAULT_TILES; shrunk to the problem).
    lowering: "triton" | "mosaic" | None (from the backend). interpret: None = True on CPU.
    debug_poison_output: alias a NaN-filled buffer as the output so any row the kernel fails to
    write stays NaN (for tests; costs an extra output-sized buffer).
    """
    batch, n_q, heads, head_dim = q.shape
    _, n_keys, kv_heads, _ = k.shape
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k {k.shape} and v {v.shape} must be [B, L, KVH, D] matching q {q.shape}")
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of kv heads ({kv_heads})")
    lowering = lowering or default_lowering()
    if lowering not in LOWERINGS:
        raise ValueError(f"lowering must be one of {LOWERINGS}, got {lowering!r}")
    interpret = default_interpret() if interpret is None else interpret
    base = DEFAULT_TILES["interpret" if interpret else lowering]
    tiles = dataclasses.replace(base, block_q=block_q or base.block_q, block_k=block_k or base.block_k)
    tiles = _fit_tiles(tiles, n_q, n_keys, lowering, interpret)
    group = heads // kv_heads

    # Pad only what the tiling needs; bucketed serving shapes (multiples of the tiles, head dim
    # 128) take no copies. Padded queries are zeros (sliced off); padded keys lie past valid_len.
    padded_d = _padded_head_dim(head_dim, lowering)
    padded_q = _round_up(n_q, tiles.block_q)
    padded_l = _round_up(n_keys, tiles.block_k)
    q = jnp.pad(q, ((0, 0), (0, padded_q - n_q), (0, 0), (0, padded_d - head_dim)))
    k = jnp.pad(k, ((0, 0), (0, padded_l - n_keys), (0, 0), (0, padded_d - head_dim)))
    v = jnp.pad(v, ((0, 0), (0, padded_l - n_keys), (0, 0), (0, padded_d - head_dim)))
    q = q.reshape(batch, padded_q, heads * padded_d)
    k = k.reshape(batch, padded_l, kv_heads * padded_d)
    v = v.reshape(batch, padded_l, kv_heads * padded_d)
    valid = jnp.clip(jnp.asarray(valid_len, jnp.int32).reshape(batch), 0, n_keys)

    grid = _query_tiles_grid(batch, heads, padded_q // tiles.block_q)
    # Index maps take (b, h, i) and, under scalar prefetch, the prefetched refs as trailing args.
    q_spec = pl.BlockSpec((None, tiles.block_q, padded_d), lambda b, h, i, *_: (b, i, h))
    kv_spec = pl.BlockSpec((None, padded_l, padded_d), lambda b, h, i, *_: (b, 0, h // group))
    out_spec = pl.BlockSpec((None, tiles.block_q, padded_d), lambda b, h, i, *_: (b, i, h))
    in_specs = [q_spec, kv_spec, kv_spec]
    operands = [q, k, v]
    aliases = {}
    if debug_poison_output:
        in_specs.append(out_spec)
        operands.append(jnp.full(q.shape, jnp.nan, q.dtype))
        aliases = {len(operands): 0}  # operand index counts valid_len, which comes first
    out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    kernel = functools.partial(
        _flash_kernel,
        scale=1.0 / math.sqrt(head_dim),
        block_k=tiles.block_k,
        valid_from_smem=lowering == "mosaic",
        precision=products_precision(q.dtype),  # the reference's: exact f32 products (no TF32 on GPU)
    )
    itemsize = q.dtype.itemsize
    cost = pl.CostEstimate(
        flops=4 * batch * heads * padded_q * padded_l * padded_d,
        transcendentals=batch * heads * padded_q * padded_l,
        bytes_accessed=itemsize * (2 * q.size + k.size + v.size),
    )
    if lowering == "mosaic":
        from jax.experimental.pallas import tpu as pltpu

        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=grid, in_specs=in_specs, out_specs=out_spec
        )
        call_args = dict(grid_spec=grid_spec)
        operands = [valid, *operands]
    else:
        valid_spec = pl.BlockSpec((None, 1), lambda b, h, i: (b, 0))
        call_args = dict(grid=grid, in_specs=[valid_spec, *in_specs], out_specs=out_spec)
        operands = [valid.reshape(batch, 1), *operands]
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=None if interpret else _compiler_params(lowering, tiles),
        cost_estimate=cost,
        interpret=interpret,
        name="dilaserve_flash_attention",
        **call_args,
    )(*operands)
    return out.reshape(batch, padded_q, heads, padded_d)[:, :n_q, :, :head_dim]
