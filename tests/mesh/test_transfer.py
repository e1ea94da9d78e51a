"""TransferPlan: a params tree from training shardings into a serving instance, bit for bit (or
cast exactly as astype), device to device, in one call per source and destination device."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dilaserve_jax.mesh import Layout, param_shardings
from dilaserve_jax.mesh.transfer import TransferPlan


@contextlib.contextmanager
def _host_refused():
    from jax._src import array

    with pytest.MonkeyPatch.context() as mp:
        def refuse(self):
            raise AssertionError(f"host round trip of an array {self.shape}")

        mp.setattr(array.ArrayImpl, "_value", property(refuse))
        with jax.transfer_guard_device_to_host("disallow"), jax.transfer_guard_host_to_device("disallow"):
            yield


def _training(params, style):
    devices = np.array(jax.devices()[:4])
    if style == "fsdp":
        mesh = Mesh(devices, ("fsdp",))
        spec = lambda x: P("fsdp") if x.shape[0] % 4 == 0 else P()  # noqa: E731
    elif style == "2d":
        mesh = Mesh(devices.reshape(2, 2), ("data", "model"))
        spec = lambda x: P("data", "model") if x.ndim == 2 and x.shape[0] % 2 == 0 else P()  # noqa: E731
    else:  # replicated on the 4 training devices
        mesh = Mesh(devices, ("fsdp",))
        spec = lambda x: P()  # noqa: E731
    return jax.device_put(params, jax.tree.map(lambda x: NamedSharding(mesh, spec(x)), params))


def _plan(leaves, targets, dtypes=None):
    return TransferPlan([(x.shape, x.dtype, x.sharding) for x in leaves], targets, dtypes)


@pytest.mark.parametrize("style, cast", [("fsdp", True), ("2d", False), ("replicated", False)])
def test_training_shards_reach_a_tp2_instance_exactly_and_without_host(model, cfg, style, cast):
    leaves = jax.tree.leaves(_training(model[1], style))
    inst = Layout.build("2x2", devices=jax.devices()[4:], config=cfg).instances[1]  # devices 6-7
    targets = jax.tree.leaves(param_shardings(model[1], inst, cfg))
    dtypes = [jnp.bfloat16] * len(leaves) if cast else None
    plan = _plan(leaves, targets, dtypes)
    assert len(plan._cut_calls) <= 4 and len(plan._join_calls) <= 2  # one call per device at most
    for _ in range(2):  # the second run reuses the compiled calls
        with _host_refused():
            out = plan(leaves)
        for got, want, target in zip(out, jax.tree.leaves(model[1]), targets):
            assert got.sharding == target and {d.id for d in got.sharding.device_set} == {6, 7}
            expected = np.asarray(want.astype(jnp.bfloat16) if cast else want)
            assert got.dtype == expected.dtype and np.asarray(got).tobytes() == expected.tobytes()


def test_same_shards_on_other_devices_are_only_copied(model, cfg):
    layout = Layout.build("2x2", devices=jax.devices()[4:], config=cfg)
    first, second = layout.instances
    leaves = jax.tree.leaves(_plan(*_inputs(model[1], cfg, first))(jax.tree.leaves(jax.device_put(
        model[1], param_shardings(model[1], first, cfg)))))
    plan = _plan(leaves, jax.tree.leaves(param_shardings(model[1], second, cfg)))
    assert plan._cut_calls == [] and plan._join_calls == []  # whole shards: one batched copy
    with _host_refused():
        out = plan(leaves)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(out, jax.tree.leaves(model[1])))


def _inputs(params, cfg, inst):
    placed = jax.tree.leaves(jax.device_put(params, param_shardings(params, inst, cfg)))
    return placed, jax.tree.leaves(param_shardings(params, inst, cfg))


def test_a_plan_refuses_inputs_it_was_not_built_for(model, cfg):
    fsdp = jax.tree.leaves(_training(model[1], "fsdp"))
    inst = Layout.build("1x2", devices=jax.devices()[4:6], config=cfg).instances[0]
    plan = _plan(fsdp, jax.tree.leaves(param_shardings(model[1], inst, cfg)))
    other = jax.tree.leaves(_training(model[1], "2d"))
    assert plan.matches(fsdp) and not plan.matches(other)
    with pytest.raises(ValueError, match="differ from the shapes, dtypes or shardings"):
        plan(other)
    with pytest.raises(ValueError, match="source leaves for"):
        TransferPlan([(x.shape, x.dtype, x.sharding) for x in fsdp], [])
