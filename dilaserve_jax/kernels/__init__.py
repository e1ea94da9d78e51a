"""Attention implementations. Every attention call in the model goes through `attention`."""
from __future__ import annotations

import jax

from dilaserve_jax.kernels.reference import reference_attention

IMPLEMENTATIONS = ("auto", "xla", "pallas")


def resolve_attention(impl: str) -> str:
    """Map "auto" to the implementation for the default backend: Pallas on GPU/TPU, XLA on CPU."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"attention must be one of {IMPLEMENTATIONS}, got {impl!r}")
    if impl == "auto":
        return "pallas" if jax.default_backend() in ("gpu", "cuda", "rocm", "tpu") else "xla"
    return impl


# Float32 scores one XLA attention call materialises at a time. A refresh at batch 32 on a 160-token
# canvas makes 26 MB of scores per layer, which spill out of the CPU caches and ran 2.5x slower than
# the same rows taken four at a time (docs/decode_throughput.md); a few MB stay cache-sized.
SCORE_CHUNK_BYTES = 4 << 20


def rows_per_chunk(batch: int, n_q: int, n_heads: int, n_keys: int, budget: int | None = None) -> int:
    """The most batch rows (a divisor of `batch`) whose float32 scores fit `budget` bytes (default
    SCORE_CHUNK_BYTES), at least 1."""
    budget = SCORE_CHUNK_BYTES if budget is None else budget
    rows = max(1, min(batch, budget // (4 * n_heads * n_q * n_keys)))
    while batch % rows:
        rows -= 1
    return rows


def xla_attention(q, k, v, valid_len):
    """`reference_attention`, a few batch rows at a time when the whole batch's scores would be
    large (SCORE_CHUNK_BYTES). Rows never interact: a row's result can differ from the one-call
    result only by the float32 rounding of the dot strategy XLA picks for another row count (as
    between two batch buckets)."""
    batch = q.shape[0]
    rows = rows_per_chunk(batch, q.shape[1], q.shape[2], k.shape[1])
    if rows == batch:
        return reference_attention(q, k, v, valid_len)

    def split(x):
        return x.reshape(batch // rows, rows, *x.shape[1:])

    out = jax.lax.map(lambda chunk: reference_attention(*chunk), (split(q), split(k), split(v), split(valid_len)))
    return out.reshape(q.shape)


def describe_attention(impl: str) -> str:
    """One line naming what `impl` runs as on this backend, for start-up logs."""
    resolved = resolve_attention(impl)
    backend = jax.default_backend()
    if resolved == "xla":
        return f"attention={impl} -> xla reference (backend {backend})"
    from dilaserve_jax.kernels.flash import default_interpret, default_lowering

    mode = "interpret mode" if default_interpret() else "compiled"
    return f"attention={impl} -> pallas flash kernel ({default_lowering()} layout, {mode}, backend {backend})"


def attention(q, k, v, valid_len, impl: str = "xla", **kernel_options):
    """Bidirectional GQA attention of q [B,Q,H,D] over k/v [B,L,KVH,D], keys masked past valid_len [B].

    kernel_options (block_q, block_k, lowering, interpret) go to the Pallas kernel only. Inputs laid
    out on an instance mesh by the sharding table run the kernel per device on its own heads.
    """
    impl = resolve_attention(impl)
    if impl == "xla":
        return xla_attention(q, k, v, valid_len)
    # Pallas, imported lazily. On a tensor-parallel instance it runs per shard over the inputs' mesh.
    from dilaserve_jax.kernels.sharded import flash_attention_on_inputs_mesh

    return flash_attention_on_inputs_mesh(q, k, v, valid_len, **kernel_options)
