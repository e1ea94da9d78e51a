"""A full reference decoding run with attention="pallas" (interpret mode on CPU) gives xla's tokens."""
import dataclasses

import numpy as np
from flax import nnx

from dilaserve_jax.decoding.reference import generate
from dilaserve_jax.kernels import flash
from dilaserve_jax.models import init_model, test

PROMPT = [ord(c) for c in "sort 3142"]


def _split_model(cfg):
    model = init_model(cfg, seed=0)
    # A sharper LM head gives well-separated confidences, so threshold 0.9 commits several tokens
    # per step and exercises the commit rule, not only the argmax.
    model.lm_head.kernel[...] = model.lm_head.kernel[...] * 12.0
    return nnx.split(model)


def test_pallas_decoding_gives_the_same_greedy_tokens_as_xla(monkeypatch):
    kernel_calls = []
    real_kernel = flash.flash_attention

    def counting_kernel(*args, **kwargs):
        kernel_calls.append(args[0].shape)
        return real_kernel(*args, **kwargs)

    monkeypatch.setattr(flash, "flash_attention", counting_kernel)
    runs = {}
    for impl in ("xla", "pallas"):
        cfg = dataclasses.replace(test(), attention=impl)
        graphdef, params = _split_model(cfg)
        runs[impl] = generate(graphdef, params, cfg, PROMPT, gen_length=24, block_length=8, threshold=0.9)
    assert kernel_calls, "attention='pallas' never reached the Pallas kernel"
    xla, pallas = runs["xla"], runs["pallas"]
    assert len(xla.answer) > 0 and max(xla.committed_per_step) > 1
    assert pallas.answer == xla.answer
    assert pallas.committed_per_step == xla.committed_per_step
    np.testing.assert_array_equal(pallas.canvas, xla.canvas)
