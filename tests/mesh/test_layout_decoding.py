"""Greedy decoding gives the same tokens (and logits within float32 tolerance) under every layout."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dilaserve_jax.decoding import reference
from dilaserve_jax.mesh import Layout, place_params, replicate_to_instances

LAYOUTS = ("1x8", "2x4", "4x2", "8x1", "4+2+1+1")
PROMPT_LEN, GEN_LEN, BLOCK_LEN = 6, 4, 2
N_REQUESTS = 8  # every instance of every layout serves at least one


def _prompts(cfg, n=N_REQUESTS):
    rng = np.random.default_rng(0)
    return [rng.integers(3, cfg.vocab_size, PROMPT_LEN).tolist() for _ in range(n)]


def _canvas(cfg, prompt):
    return jnp.asarray(prompt + [cfg.mask_id] * GEN_LEN, dtype=jnp.int32)


@pytest.fixture(scope="module")
def single_device(model, cfg):
    graphdef, params = model
    prompts = _prompts(cfg)
    logits = [np.asarray(reference._logits(graphdef, params, _canvas(cfg, p))) for p in prompts]
    answers = [reference.generate(graphdef, params, cfg, p, GEN_LEN, BLOCK_LEN).canvas for p in prompts]
    return prompts, logits, answers


@pytest.mark.parametrize("spec", LAYOUTS)
def test_greedy_decoding_matches_single_device(model, cfg, single_device, spec):
    graphdef, params = model
    prompts, want_logits, want_canvases = single_device
    layout = Layout.build(spec, config=cfg)
    first = layout.instances[0]
    per_instance = replicate_to_instances(place_params(params, first, cfg), first, layout, cfg)
    for k, inst in enumerate(layout.instances):  # one request per instance, every instance serves
        prompt = prompts[k]
        inst_params = per_instance[inst.index]
        assert {d for leaf in jax.tree_util.tree_leaves(inst_params) for d in leaf.devices()} == set(inst.devices)
        logits = reference._logits(graphdef, inst_params, _canvas(cfg, prompt))
        assert logits.sharding.device_set <= set(inst.devices)  # computed on the instance, not elsewhere
        np.testing.assert_allclose(np.asarray(logits), want_logits[k], rtol=1e-5, atol=1e-5)
        got = reference.generate(graphdef, inst_params, cfg, prompt, GEN_LEN, BLOCK_LEN)
        np.testing.assert_array_equal(got.canvas, want_canvases[k])
