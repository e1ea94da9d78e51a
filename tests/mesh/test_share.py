"""A device share: device lists, layouts over a subset, and decode slots sized by a per-device budget."""
import jax
import pytest

from dilaserve_jax.decoding.state import init_state, state_shardings
from dilaserve_jax.mesh import Layout, kv_cache_sharding
from dilaserve_jax.mesh.share import bytes_per_device, parse_device_ids, select_devices, share_layout
from dilaserve_jax.models.memory import GIB, device_bytes_per_slot, slots_for_device_budget, slots_within
from dilaserve_jax.models import test, tiny
from dilaserve_jax.serving.executor.build import ServeConfig, build_cluster


def test_device_lists_parse_ranges_and_lists():
    assert parse_device_ids("4-7") == (4, 5, 6, 7)
    assert parse_device_ids("4,5,6,7") == parse_device_ids(" 4, 5-7 ")
    assert parse_device_ids("0-1,6") == (0, 1, 6)
    for bad, why in (("", "empty"), ("4-", "cannot parse"), ("a", "cannot parse"), ("7-4", "backwards"),
                     ("1,1", "twice")):
        with pytest.raises(ValueError, match=why):
            parse_device_ids(bad)


def test_selecting_devices_names_the_missing_ones():
    assert [d.id for d in select_devices((6, 4))] == [6, 4]
    with pytest.raises(ValueError, match=r"device id\(s\) \[8, 9\] are not visible: this process sees 8 cpu"):
        select_devices((7, 8, 9))


def test_a_layout_over_a_share_uses_only_those_devices():
    layout = share_layout("2x2", (4, 5, 6, 7))
    assert [inst.device_ids for inst in layout.instances] == [(4, 5), (6, 7)]
    assert share_layout("2x4", None).devices == tuple(jax.devices())
    with pytest.raises(ValueError, match=r"mesh 2x4 uses 8 device\(s\) but the device share \[4, 5, 6, 7\] has 4"):
        share_layout("2x4", (4, 5, 6, 7))
    with pytest.raises(ValueError, match=r"mesh 2x1 uses 2 device\(s\) but the device share \[4, 5, 6, 7\] has 4"):
        share_layout("2x1", (4, 5, 6, 7))
    assert len(share_layout("2x1", (4, 5, 6, 7), allow_unused=True).devices) == 2


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_slot_bytes_per_device_match_the_placed_state(tp):
    cfg = tiny()  # 4 kv heads: split at TP 1-4
    inst = Layout.build(f"1x{tp}", devices=jax.devices()[:tp]).instances[0]
    template = init_state(cfg, 1, 1)
    state = init_state(cfg, 3, 128, sharding=state_shardings(template, kv_cache_sharding(inst, cfg),
                                                             inst.sharding(jax.sharding.PartitionSpec())))
    held = bytes_per_device(state)
    assert set(held) == set(inst.device_ids)
    assert all(b == 3 * device_bytes_per_slot(cfg, tp, 128) for b in held.values())
    assert device_bytes_per_slot(cfg, tp, 128, with_cache=False) == 4 * 128 + 4 * 7


def test_budget_sizes_slots_and_says_when_none_fits():
    cfg = test()
    one = device_bytes_per_slot(cfg, 2, 128)
    assert slots_for_device_budget(cfg, 2, 128, 3 * one + one - 1) == 3
    assert slots_within(cfg, 2, 128, 100 * one, cap=8) == 8
    assert slots_within(cfg, 2, 128, 5 * one, cap=8) == 5
    with pytest.raises(ValueError, match="holds no slot: one slot of a 128-token canvas needs .* TP-2"):
        slots_within(cfg, 2, 128, one - 1, cap=8)
    with pytest.raises(ValueError, match="non-negative"):
        slots_for_device_budget(cfg, 2, 128, -1)


def test_build_cluster_on_a_share_with_a_kv_budget():
    """What `serve --devices 4-7 --mesh 2x2 --kv-memory-gb X` builds: every array on the share, and
    as many slots as X holds per device on the narrowest instance any layout of the share may use
    (TP 1 here, whose devices hold whole K/V), so the budget also holds after a reconfiguration."""
    cfg = test()
    one = device_bytes_per_slot(cfg, 1, 128)
    budget_gib = (3 * one + 10) / GIB
    serve = ServeConfig(model="test", mesh="2x2", devices=(4, 5, 6, 7), slots=8, kv_memory_gb=budget_gib,
                        length_buckets=(128,), step_timeout_s=None, controller="manual")
    lines = []
    cluster = build_cluster(serve, say=lines.append)
    assert any("devices [4, 5, 6, 7] of 8" in line for line in lines)
    assert sum("3 slot(s)" in line and "decode state (KV budget" in line for line in lines) == 2
    for engine, want in zip(cluster.engines, ({4, 5}, {6, 7})):
        decoder = engine.runner.decoder
        assert decoder.num_slots == 3 and engine.scheduler.cfg.num_slots == 3
        assert engine.scheduler.cfg.rider_cost == 0.1 and engine.scheduler.cfg.starved_at_risk_slots == 1
        for leaf in jax.tree.leaves(decoder.params) + jax.tree.leaves(decoder.state):
            assert {d.id for d in leaf.sharding.device_set} == want
        assert all(b <= budget_gib * GIB for b in bytes_per_device(decoder.state).values())
    # restricted to TP-2 layouts, the same budget holds twice the slots (K/V split over 2 devices)
    two = device_bytes_per_slot(cfg, 2, 128)
    tp2_only = build_cluster(ServeConfig(model="test", mesh="2x2", devices=(4, 5, 6, 7), slots=8,
                                         kv_memory_gb=(5 * two + 10) / GIB, length_buckets=(128,), layouts=("2x2",),
                                         controller="manual", overload_rules=False), say=lambda _m: None)
    assert [e.runner.num_slots for e in tp2_only.engines] == [5, 5]
    # serve --no-overload-rules reaches every instance's scheduler
    assert all(e.scheduler.cfg.rider_cost == float("inf") and e.scheduler.cfg.starved_at_risk_slots is None
               and not e.scheduler.cfg.shortest_late_first for e in tp2_only.engines)
    with pytest.raises(ValueError, match="holds no slot"):
        build_cluster(ServeConfig(model="test", mesh="2x2", devices=(4, 5, 6, 7), kv_memory_gb=1e-9,
                                  length_buckets=(128,)), say=lambda _m: None)
    with pytest.raises(ValueError, match="KV memory budget must be positive"):
        ServeConfig(kv_memory_gb=0)
    with pytest.raises(ValueError, match="distinct"):
        ServeConfig(devices=(1, 1))
