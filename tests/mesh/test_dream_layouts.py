"""A Dream checkpoint loaded straight into TP 2 and TP 4 instances (biases sharded with their
projections; kv heads split at TP 2, replicated at TP 4) decodes the same tokens as TP 1, also
with the per-shard Pallas kernel (interpret mode here) on the dual reuse steps' block + 1 rows."""
import jax
import pytest
from jax.sharding import PartitionSpec as P

from dilaserve_jax.core.kinds import CacheMode
from dilaserve_jax.decoding.decoder import DecoderConfig, SlotDecoder
from dilaserve_jax.decoding.offline import DecodeRequest, generate_many
from dilaserve_jax.decoding.state import init_state, state_shardings
from dilaserve_jax.mesh import Layout, kv_cache_sharding
from dilaserve_jax.mesh.placement import load_into_layout
from dilaserve_jax.models.config import DREAM_ARCHITECTURE
from dilaserve_jax.models.hf import abstract_params
from tests.dream_support import write_dream_checkpoint
from tests.mesh.conftest import tp8_config

CONFIG = DecoderConfig(num_slots=2, length_buckets=(32,), block_buckets=(8,), cache_mode=CacheMode.DUAL)
REQUESTS = [DecodeRequest(prompt=(5, 9, 11, 40, 7, 3), answer_length=16, block_length=8),
            DecodeRequest(prompt=(60, 61, 62, 12), answer_length=12, block_length=8, tau=0.5)]


def _answers(path, tp: int, attention: str = "xla"):
    layout = Layout.build(f"1x{tp}", jax.devices()[:tp])
    loaded, per_instance = load_into_layout(path, layout)
    inst, cfg = layout.instances[0], loaded.config.replace(attention=attention)
    bias = per_instance[0]["blocks"][0]["q_proj"]["bias"]
    assert bias.sharding.spec == (P() if tp == 1 else P("model"))
    state_like = jax.eval_shape(lambda: init_state(cfg, CONFIG.num_slots, CONFIG.max_length))
    sharding = state_shardings(state_like, kv_cache_sharding(inst, cfg), inst.sharding(P()))
    decoder = SlotDecoder(cfg, abstract_params(cfg)[0], per_instance[0], CONFIG, state_sharding=sharding,
                          warm_up=False, progress=False)
    results, _ = generate_many(decoder, REQUESTS)
    assert decoder.devices == frozenset(inst.devices)
    return [r.answer for r in results]


@pytest.mark.slow
def test_dream_tp2_and_tp4_decode_the_tp1_tokens(tmp_path):
    cfg = tp8_config().replace(pad_id=1, rope_theta=1e6, rms_eps=1e-6, **DREAM_ARCHITECTURE)
    path = write_dream_checkpoint(tmp_path / "dream", cfg, seed=6, head_scale=12.0)
    want = _answers(path, 1)
    assert any(len(set(a)) > 1 for a in want)  # not a degenerate constant answer
    for tp in (2, 4):
        assert _answers(path, tp) == want, f"TP {tp}"
    assert _answers(path, 2, attention="pallas") == want
