"""Slot sizing from a memory budget, bucket helpers and configuration validation (no compilation)."""
import pytest

from dilaserve_jax.core.buckets import bucket_for, powers_of_two_up_to
from dilaserve_jax.core.kinds import CacheMode
from dilaserve_jax.decoding.buckets import StepShape, StepType, prefix_query_buckets, shapes_for
from dilaserve_jax.decoding.decoder import DecoderConfig
from dilaserve_jax.decoding.state import init_state
from dilaserve_jax.models.config import llada_8b, test, tiny
from dilaserve_jax.models.memory import bytes_per_slot, kv_bytes_per_slot, slots_for_budget

MiB = 2**20


@pytest.mark.parametrize("cfg,length,mib", [(tiny(), 1024, 4), (tiny(), 4096, 16),
                                            (llada_8b(), 1024, 512), (llada_8b(), 4096, 2048)])
def test_kv_bytes_per_slot(cfg, length, mib):
    assert kv_bytes_per_slot(cfg, length) == mib * MiB


def test_slots_for_budget_fits_the_budget():
    cfg = llada_8b()
    budget = 64 * 2**30
    n = slots_for_budget(cfg, 1024, budget)
    assert n == 127
    assert n * bytes_per_slot(cfg, 1024) <= budget < (n + 1) * bytes_per_slot(cfg, 1024)
    assert slots_for_budget(cfg, 4096, 2**30) == 0
    assert slots_for_budget(cfg, 1024, 2**30, with_cache=False) > 10**5  # cache mode none holds no K/V


def test_init_state_shapes_and_cacheless_state():
    cfg = test()
    st = init_state(cfg, 3, 32)
    assert st.canvas.shape == (3, 32) and st.num_slots == 3 and st.length == 32
    assert len(st.kv) == cfg.n_layers and st.kv[0].k.shape == (3, 32, cfg.n_kv_heads, cfg.head_dim)
    assert init_state(cfg, 3, 32, with_cache=False).kv == ()
    with pytest.raises(ValueError):
        init_state(cfg, 1, cfg.max_len + 1)


def test_buckets():
    assert powers_of_two_up_to(16) == (1, 2, 4, 8, 16)
    assert powers_of_two_up_to(12) == (1, 2, 4, 8, 12)
    assert prefix_query_buckets(256, 32) == (32, 64, 128, 256)
    assert bucket_for(33, (32, 64)) == 64
    with pytest.raises(ValueError):
        bucket_for(65, (32, 64))


def test_shapes_for_each_mode():
    none = shapes_for(CacheMode.NONE, (1, 2), (64,), (16,))
    dual = shapes_for(CacheMode.DUAL, (1, 2), (64,), (16,))
    prefix = shapes_for(CacheMode.PREFIX, (1, 2), (64,), (16,))
    assert {s.step for s in none} == {StepType.FULL} and len(none) == 2
    assert len(dual) == 4 and {s.queries for s in dual if s.step is StepType.DUAL} == {16}
    assert len(prefix) == 2 * (1 + 3)


def test_step_shape_and_config_validation():
    with pytest.raises(ValueError):
        StepShape(StepType.DUAL, 1, 64, 16, 32)
    with pytest.raises(ValueError):
        StepShape(StepType.REFRESH, 1, 64, 16, 16)
    with pytest.raises(ValueError):
        DecoderConfig(0, (64,))
    with pytest.raises(ValueError):
        DecoderConfig(2, (16,), (32,))
    with pytest.raises(ValueError):
        DecoderConfig(2, (64,), cache_mode="lru")
    cfg = DecoderConfig(6, (128, 64, 64), (16,), "prefix")
    assert cfg.length_buckets == (64, 128) and cfg.batch_buckets == (1, 2, 4, 6) and cfg.cache_mode is CacheMode.PREFIX


def test_decoder_config_from_a_memory_budget():
    cfg = DecoderConfig.from_budget(tiny(), 64 * MiB, (256,), (32,), "dual")
    assert cfg.num_slots == 64 * MiB // bytes_per_slot(tiny(), 256)
    assert DecoderConfig.from_budget(tiny(), 64 * MiB, (256,), max_slots=16).num_slots == 16
    with pytest.raises(ValueError):
        DecoderConfig.from_budget(llada_8b(), MiB, (1024,))
