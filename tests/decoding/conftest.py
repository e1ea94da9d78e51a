"""Shared fixtures for the fast-decoding tests: a sharpened test model and one executable cache.

All decoders here share a CompiledSteps per model structure: executables depend on shapes and
placement only (not on weight values), so tests compile each step shape once per session.
"""
import pytest
from flax import nnx

from dilaserve_jax.core.kinds import CacheMode
from dilaserve_jax.decoding.compiled import CompiledSteps
from dilaserve_jax.decoding.decoder import DecoderConfig, SlotDecoder
from dilaserve_jax.models import init_model, test

LENGTH, BLOCK = 64, 16


@pytest.fixture(scope="session")
def sharp_model():
    """The test model with a scaled-up LM head: confident, varied proposals, so τ < 1 commits several."""
    cfg = test()
    model = init_model(cfg, seed=0)
    model.lm_head.kernel[...] = model.lm_head.kernel[...] * 12.0
    graphdef, params = nnx.split(model)
    return cfg, graphdef, params


@pytest.fixture(scope="session")
def shared_compiled(sharp_model):
    cfg, graphdef, _ = sharp_model
    return CompiledSteps(cfg, graphdef)


@pytest.fixture(scope="session")
def make_decoder(sharp_model, shared_compiled):
    """make_decoder(mode, slots=4) -> a SlotDecoder compiling on demand (no start-up warm-up)."""
    cfg, graphdef, params = sharp_model

    def make(mode: str, slots: int = 4, lengths=(LENGTH,), blocks=(BLOCK,)) -> SlotDecoder:
        return SlotDecoder(cfg, graphdef, params, DecoderConfig(slots, lengths, blocks, CacheMode(mode)),
                           compiled=shared_compiled, warm_up=False, progress=False)

    return make
