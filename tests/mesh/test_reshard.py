"""Live resharding keeps every bit, moves device to device only, and reports what it moved."""
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from mesh_support import host_copy

from dilaserve_jax.mesh import Layout, place_params, replicate_to_instances, reshard
from dilaserve_jax.mesh.sharding import param_shardings


def _host_refused(request):
    """Fail on any fetch to host memory: transfer guards do not see JAX's internal fallback
    (ArrayImpl._value) that device_put takes for reshards it cannot do between devices."""
    import contextlib

    @contextlib.contextmanager
    def scope():
        with pytest.MonkeyPatch.context() as mp:
            from jax._src import array

            def refuse(self):
                raise AssertionError(f"host round trip of an array {self.shape} during resharding")

            mp.setattr(array.ArrayImpl, "_value", property(refuse))
            with jax.transfer_guard_device_to_host("disallow"), jax.transfer_guard_host_to_device("disallow"):
                yield
    return scope()


def _held_bytes(per_instance) -> int:
    return sum(s.data.nbytes for p in per_instance for leaf in jax.tree_util.tree_leaves(p) for s in leaf.addressable_shards)


def _in_layout(params, layout, cfg):
    first = layout.instances[0]
    return replicate_to_instances(place_params(params, first, cfg), first, layout, cfg)


def _assert_placed(per_instance, layout, cfg):
    for inst, params in zip(layout.instances, per_instance):
        for leaf, sharding in zip(jax.tree_util.tree_leaves(params),
                                  jax.tree_util.tree_leaves(param_shardings(params, inst, cfg))):
            assert leaf.sharding == sharding


def test_reshard_cycle_is_bit_exact_and_device_to_device(model, cfg, request):
    want = host_copy(model[1])
    layout = Layout.build("2x4", config=cfg)
    per_instance = _in_layout(model[1], layout, cfg)
    reports = []
    for spec in ("8x1", "4+2+1+1", "2x4"):
        new_layout = Layout.build(spec, config=cfg)
        with _host_refused(request):  # the weights must go device to device
            per_instance, report = reshard(per_instance, layout, new_layout, cfg)
        assert report.bytes_total == _held_bytes(per_instance)
        assert len(per_instance) == len(new_layout.instances)
        _assert_placed(per_instance, new_layout, cfg)
        for params in per_instance:
            got = host_copy(params)
            assert got.keys() == want.keys()
            for path in want:
                assert got[path].dtype == want[path].dtype
                assert got[path].tobytes() == want[path].tobytes(), path
        layout = new_layout
        reports.append(report)
    model_bytes = sum(a.nbytes for a in want.values())
    to_replicas, to_mixed, back = reports
    assert (to_replicas.old_spec, to_replicas.new_spec) == ("2x4", "8x1")
    assert to_replicas.bytes_total == 8 * model_bytes
    # Each TP-1 replica already held 1/4 of the split parameters, and all replicated ones (norms, GQA k/v).
    assert 0 < to_replicas.bytes_moved < to_replicas.bytes_total
    # TP 4 -> TP 1 joins copied shards on the new device; nothing needs a full all-gather.
    assert all(r.bytes_gathered == 0 for r in reports)
    assert 0 < back.bytes_moved < back.bytes_total  # TP4[0-3] is kept as it is
    assert all(r.seconds > 0 for r in reports)
    assert "2x4 -> 8x1" in str(to_replicas)


def test_reshard_to_the_same_layout_moves_nothing(model, cfg):
    layout = Layout.build("4x2", config=cfg)
    per_instance = _in_layout(model[1], layout, cfg)
    same, report = reshard(per_instance, layout, Layout.build("4x2", config=cfg), cfg)
    assert report.bytes_moved == 0 and report.bytes_gathered == 0 and report.instances_copied == 0
    assert report.bytes_total == _held_bytes(per_instance)
    assert all(a is b for p, q in zip(per_instance, same)
               for a, b in zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(q)))


def test_finer_split_slices_on_device_without_gathering(model, cfg):
    want = host_copy(model[1])
    layout = Layout.build("4x2", config=cfg)
    per_instance = _in_layout(model[1], layout, cfg)
    # TP 2 -> 4 -> 8: every new shard lies inside an old one (the GQA k/v kernels, split at TP 2 and
    # replicated at TP 4, are joined from their halves instead).
    for spec in ("2x4", "1x8"):
        new_layout = Layout.build(spec, config=cfg)
        with _host_refused(None):
            per_instance, report = reshard(per_instance, layout, new_layout, cfg)
        assert report.bytes_gathered == 0 and report.bytes_moved > 0
        _assert_placed(per_instance, new_layout, cfg)
        assert all(host_copy(p)[k].tobytes() == want[k].tobytes() for p in per_instance for k in want)
        layout = new_layout


@pytest.mark.parametrize("old_spec, new_spec, path", [
    (P(None, "model"), P("model", None), "pieces"),  # columns -> rows: cut, copy and join the overlaps
    (P(None, "model"), P(None, "model"), "merge"),  # 4 -> 2 devices: join pairs
    (P(None, "model"), P(), "merge"),
    (P("model", None), P("model", None), "split"),  # 2 -> 4 devices, as 4 -> 8 below
])
def test_move_never_goes_through_host(old_spec, new_spec, path):
    from jax.sharding import Mesh, NamedSharding

    from dilaserve_jax.mesh.reshard import _merge_plan, _needs_gather, _piece_plan, _split_plan, move

    devices = jax.devices()
    n_old = 2 if path == "split" else 4
    old_mesh, new_mesh = Mesh(np.array(devices[:n_old]), ("model",)), Mesh(np.array(devices[3:3 + 8 - n_old - 2]), ("model",))
    value = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    old = jax.device_put(value, NamedSharding(old_mesh, old_spec))
    target = NamedSharding(new_mesh, new_spec)
    assert not _needs_gather(old, target)
    assert (_split_plan(old, target) is not None) == (path == "split")
    assert (_merge_plan(old, target) is not None) == (path == "merge")
    assert _piece_plan(old, target) is not None  # the general plan covers the special ones too
    with _host_refused(None):
        new = move(old, target)
    assert new.sharding == target
    np.testing.assert_array_equal(np.asarray(new), value)


def test_reshard_rejects_mismatched_inputs(model, cfg):
    layout = Layout.build("2x4", config=cfg)
    with pytest.raises(ValueError, match="params for 1 instances, old layout 2x4 has 2"):
        reshard([model[1]], layout, Layout.build("8x1"), cfg)


def test_all_gather_fallback_still_moves_device_to_device(monkeypatch):
    """Shardings whose pieces form no grid (none of the table's) take the all-gather path."""
    from jax.sharding import Mesh, NamedSharding

    import importlib

    reshard_module = importlib.import_module("dilaserve_jax.mesh.reshard")  # the package exports the function
    monkeypatch.setattr(reshard_module, "_piece_plan", lambda old, new: None)
    devices = jax.devices()
    value = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    old = jax.device_put(value, NamedSharding(Mesh(np.array(devices[:4]), ("model",)), P(None, "model")))
    target = NamedSharding(Mesh(np.array(devices[4:6]), ("model",)), P("model", None))
    assert reshard_module._needs_gather(old, target)
    with _host_refused(None):
        new = reshard_module.move(old, target)
    assert new.sharding == target
    np.testing.assert_array_equal(np.asarray(new), value)


def _training_shardings(params, mesh, style):
    """FSDP: every parameter's first divisible axis split over all 4 devices; 2d: ("data", "model")
    tiles over a 2x2 mesh where both axes divide."""
    from jax.sharding import NamedSharding

    def spec(x):
        if style == "fsdp":
            axis = next((a for a, n in enumerate(x.shape) if n % 4 == 0), None)
            return P() if axis is None else P(*([None] * axis), "fsdp")
        return P("data", "model") if x.ndim == 2 and x.shape[0] % 2 == 0 and x.shape[1] % 2 == 0 else P()

    return jax.tree_util.tree_map(lambda x: NamedSharding(mesh, spec(x)), params)


@pytest.mark.parametrize("style", ["fsdp", "2d"])
def test_training_sharding_on_devices_0_3_reaches_tp2_serving_on_4_7_without_host(model, cfg, style):
    from jax.sharding import Mesh

    from dilaserve_jax.mesh.reshard import _needs_gather

    want = host_copy(model[1])
    devices = jax.devices()
    mesh = Mesh(np.array(devices[:4]), ("fsdp",)) if style == "fsdp" else \
        Mesh(np.array(devices[:4]).reshape(2, 2), ("data", "model"))
    trained = jax.device_put(model[1], _training_shardings(model[1], mesh, style))
    assert {d.id for leaf in jax.tree_util.tree_leaves(trained) for d in leaf.sharding.device_set} == {0, 1, 2, 3}
    layout = Layout.build("2x2", devices=devices[4:], config=cfg)
    for inst in layout.instances:
        shardings = param_shardings(trained, inst, cfg)
        gathers = [path for path, (leaf, s) in zip(want, zip(jax.tree_util.tree_leaves(trained),
                                                              jax.tree_util.tree_leaves(shardings)))
                   if _needs_gather(leaf, s)]
        assert gathers == []  # every serving shard is cut from the training shards directly
        with _host_refused(None):
            served = place_params(trained, inst, cfg)
        for leaf, sharding in zip(jax.tree_util.tree_leaves(served), jax.tree_util.tree_leaves(shardings)):
            assert leaf.sharding == sharding and {d.id for d in leaf.sharding.device_set} <= {4, 5, 6, 7}
        got = host_copy(served)
        assert all(got[k].tobytes() == want[k].tobytes() for k in want)
