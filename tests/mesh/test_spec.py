"""Mesh spec parsing, layouts' device assignment, and every invalid spec's error message."""
from types import SimpleNamespace

import jax
import pytest
from jax.sharding import AxisType

from dilaserve_jax.mesh import Layout, MeshSpec, MeshSpecError, check_model_tp
from dilaserve_jax.models import config


@pytest.mark.parametrize("text, degrees, canonical", [
    ("2x4", (4, 4), "2x4"),
    ("8", (8,), "1x8"),
    ("1x8", (8,), "1x8"),
    ("8x1", (1,) * 8, "8x1"),
    ("4+2+1+1", (4, 2, 1, 1), "4+2+1+1"),
    ("2x2+4", (2, 2, 4), "2+2+4"),
    (" 4X2 ", (2, 2, 2, 2), "4x2"),
])
def test_parse(text, degrees, canonical):
    spec = MeshSpec.parse(text)
    assert spec.tp_degrees == degrees
    assert str(spec) == canonical
    assert MeshSpec.parse(str(spec)) == spec
    assert spec.num_devices == sum(degrees)


@pytest.mark.parametrize("text, message", [
    ("2x3", "TP degree 3 in mesh spec '2x3' is not a power of two"),
    ("6", "TP degree 6 in mesh spec '6' is not a power of two"),
    ("0", "TP degree 0 in mesh spec '0' is not a power of two"),
    ("0x4", "asks for zero instances"),
    ("", "empty mesh spec"),
    ("2x4x2", "cannot parse '2x4x2'"),
    ("4+", "cannot parse ''"),
    ("a", "cannot parse 'a'"),
    ("-4", "cannot parse '-4'"),
])
def test_parse_errors(text, message):
    with pytest.raises(MeshSpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        MeshSpec.parse(text)


def test_direct_construction_is_validated():
    with pytest.raises(MeshSpecError, match="not a power of two"):
        MeshSpec((4, 3))
    with pytest.raises(MeshSpecError, match="at least one instance"):
        MeshSpec(())


def test_device_count_errors():
    with pytest.raises(MeshSpecError, match="needs 16 devices but only 8 exist"):
        Layout.build("4x4")
    with pytest.raises(MeshSpecError, match="device count mismatch: mesh spec 2x2 uses 4 devices but 8 are available"):
        Layout.build("2x2")
    assert len(Layout.build("2x2", allow_unused=True).devices) == 4


def test_model_divisibility_errors_name_the_dimension():
    cfg = config.test()  # 4 heads, 2 kv heads, MLP 128
    with pytest.raises(MeshSpecError, match="TP 8 does not divide the 4 attention heads"):
        Layout.build("1x8", config=cfg)
    with pytest.raises(MeshSpecError, match="TP 4 does not divide the MLP width 98"):
        check_model_tp(cfg.replace(mlp_hidden=98), 4)
    with pytest.raises(MeshSpecError, match="TP 4 does not divide the 6 kv heads"):
        check_model_tp(cfg.replace(n_heads=12, n_kv_heads=6, head_dim=4), 4)
    # Several problems are all named at once.
    with pytest.raises(MeshSpecError, match="attention heads; .* MLP width"):
        check_model_tp(cfg.replace(mlp_hidden=100), 8)


def test_fewer_kv_heads_than_tp_is_allowed():
    check_model_tp(config.test(), 4)  # 2 kv heads at TP 4: replicated
    check_model_tp(config.test().replace(n_heads=12, n_kv_heads=3, head_dim=4, mlp_hidden=96), 4)  # 3 < 4: replicated
    Layout.build("2x4", config=config.test())


def test_layouts_assign_contiguous_aligned_devices():
    assert [inst.device_ids for inst in Layout.build("2x4").instances] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [inst.device_ids for inst in Layout.build("8x1").instances] == [(k,) for k in range(8)]
    assert [inst.device_ids for inst in Layout.build("4+2+1+1").instances] == [(0, 1, 2, 3), (4, 5), (6,), (7,)]
    # Written narrow-first, instances keep their order but are still placed widest-first and aligned.
    assert [inst.device_ids for inst in Layout.build("1+2+4+1").instances] == [(6,), (4, 5), (0, 1, 2, 3), (7,)]
    layout = Layout.build("2x4")
    for inst in layout.instances:
        assert inst.mesh.axis_names == ("model",)
        assert inst.mesh.devices.shape == (4,)
        assert tuple(inst.mesh.axis_types) == (AxisType.Auto,)
        assert inst.is_local
    assert layout.local_instances() == layout.instances
    assert str(Layout.build("4+2+1+1")) == "4+2+1+1 = TP4[0-3] + TP2[4-5] + TP1[6] + TP1[7]"


def test_tp_groups_never_span_processes():
    # Two fake processes of 4 devices each: a TP-8 group cannot be placed, 2x4 lands one per process.
    devices = [SimpleNamespace(id=k, process_index=k // 4) for k in range(8)]
    with pytest.raises(MeshSpecError, match=r"cannot place a TP-8 instance of 1x8 inside one process: .*\{0: 4, 1: 4\}"):
        Layout.build("1x8", devices)
    with pytest.raises(MeshSpecError, match="cannot place a TP-4"):
        Layout.build("2+4+2", [SimpleNamespace(id=k, process_index=k // 2) for k in range(8)])


def test_layout_equality_follows_devices():
    assert Layout.build("2x4") == Layout.build("2x4")
    assert Layout.build("2x4") != Layout.build("4x2")
    assert jax.devices()[0] in Layout.build("8x1").devices
