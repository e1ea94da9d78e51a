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
        return reference_attention(q, k, v, valid_len)
    # Pallas, imported lazily. On a tensor-parallel instance it runs per shard over the inputs' mesh.
    from dilaserve_jax.kernels.sharded import flash_attention_on_inputs_mesh

    return flash_attention_on_inputs_mesh(q, k, v, valid_len, **kernel_options)
