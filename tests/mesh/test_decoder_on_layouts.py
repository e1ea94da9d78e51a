"""The real decoding steps (SlotDecoder: refresh + reuse with the KV cache) on instance submeshes,
with the table's parameter and KV-cache shardings, give the single-device answers."""
import jax
import pytest
from jax.sharding import PartitionSpec as P

from dilaserve_jax.core.kinds import CacheMode
from dilaserve_jax.decoding.decoder import DecoderConfig, SlotDecoder
from dilaserve_jax.decoding.offline import DecodeRequest, generate_many
from dilaserve_jax.decoding.state import init_state, state_shardings
from dilaserve_jax.mesh import Layout, kv_cache_sharding, place_params

CONFIG = DecoderConfig(num_slots=2, length_buckets=(16,), block_buckets=(4,), cache_mode=CacheMode.DUAL)


def _requests(cfg):
    return [DecodeRequest(prompt=(5, 9, 11, 40, 7, 3), answer_length=8, block_length=4),
            DecodeRequest(prompt=(60, 61, 62, 12), answer_length=6, block_length=4, tau=0.5)]


def _decode(cfg, graphdef, params, state_sharding=None):
    decoder = SlotDecoder(cfg, graphdef, params, CONFIG, state_sharding=state_sharding, warm_up=False, progress=False)
    results, _ = generate_many(decoder, _requests(cfg))
    return decoder, [r.answer for r in results]


@pytest.mark.slow
def test_decoder_steps_on_submeshes(model, cfg):
    graphdef, params = model
    _, want = _decode(cfg, graphdef, params)
    # The TP-2 instance of 4+2+1+1: its 2 kv heads are split, one per device, in the cache too. (The
    # replicated-cache GQA case runs the same code with P(); test_layout_decoding covers TP 4 and 8.)
    inst = Layout.build("4+2+1+1", config=cfg).instances[1]
    kv = kv_cache_sharding(inst, cfg)
    assert kv.spec == P(None, None, "model", None)
    state_like = jax.eval_shape(lambda: init_state(cfg, CONFIG.num_slots, CONFIG.max_length))
    decoder, got = _decode(cfg, graphdef, place_params(params, inst, cfg),
                           state_shardings(state_like, kv, inst.sharding(P())))
    assert got == want
    assert decoder.devices == frozenset(inst.devices)
    for layer in decoder.state.kv:  # the cache kept its layout through refresh and reuse steps
        assert layer.k.sharding.is_equivalent_to(kv, 4) and layer.v.sharding.is_equivalent_to(kv, 4)
        assert {s.data.shape[2] for s in layer.k.addressable_shards} == {1}
