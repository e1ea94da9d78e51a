"""dilaserve_jax.Server inside a "training job": serving on devices 4-7 (2x2) from params sharded
FSDP-style for training on devices 0-3, with weights pushed in memory while requests run."""
import contextlib
import threading

import grpc
import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dilaserve_jax import Server
from dilaserve_jax.decoding.decoder import DecoderConfig, SlotDecoder
from dilaserve_jax.decoding.offline import DecodeRequest, generate_many
from dilaserve_jax.models import CharTokenizer, init_model, test
from dilaserve_jax.serving.cluster.weights_swap import IncompatibleWeights
from dilaserve_jax.serving.cluster.fake_runner import fake_profile
from dilaserve_jax.tasks.suite import unique_problems

pytestmark = pytest.mark.slow
TAU = 0.9
TOK = CharTokenizer()


def _model(seed):
    model = init_model(test(), seed=seed)
    model.lm_head.kernel[...] = model.lm_head.kernel[...] * 12.0  # confident proposals: τ < 1 commits several
    return nnx.split(model)


def _fsdp(params):
    """Params as a training job shards them: first axis divisible by 4 split over devices 0-3."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("fsdp",))

    def sharding(x):
        axis = next((a for a, n in enumerate(x.shape) if n % 4 == 0), None)
        return NamedSharding(mesh, P() if axis is None else P(*([None] * axis), "fsdp"))

    return jax.device_put(params, jax.tree.map(sharding, params))


def _host(params):
    return [np.asarray(jax.device_get(x)) for x in jax.tree.leaves(params)]


@contextlib.contextmanager
def _host_fetch_refused():
    """Any fetch of an array to host memory fails, on every thread (JAX's internal reshard fallback
    goes through ArrayImpl._value, which transfer guards do not see)."""
    from jax._src import array

    with pytest.MonkeyPatch.context() as mp:
        def refuse(self):
            raise AssertionError(f"host round trip of an array {self.shape}")

        mp.setattr(array.ArrayImpl, "_value", property(refuse))
        with jax.transfer_guard_device_to_host("disallow"):
            yield


PROMPTS = [p.prompt for t in ("sort", "repeat") for p in unique_problems(t, "heldout", 6, seed=11)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    profile = tmp_path_factory.mktemp("profile") / "profile.json"
    fake_profile().save(profile)  # scheduling only: answers do not depend on step-time predictions
    graphdef, params = _model(0)
    srv = Server(graphdef, _fsdp(params), devices=jax.devices()[4:], mesh="2x2", port=0, slots=2,
                 cache_mode="none", length_buckets=(64,), block_buckets=(16,), default_block_length=16,
                 default_max_new_tokens=16, default_slo_ms=600_000, profile=str(profile), step_timeout_s=None,
                 controller="manual", say=lambda _m: None)
    srv.wait_ready(600)
    yield srv
    assert srv.stop(10)


def _served(srv):
    """Per instance (params, decode state) as the engine threads hold them."""
    return [e.call(lambda r=e.runner: (r.decoder.params, r.decoder.state)).result(30) for e in srv.cluster.engines]


def test_serves_only_on_its_device_share(server):
    assert [i["device_ids"] for i in server.state()["instances"]] == [[4, 5], [6, 7]]
    for (params, state), want in zip(_served(server), ({4, 5}, {6, 7})):
        for leaf in jax.tree.leaves(params) + jax.tree.leaves(state):
            assert {d.id for d in leaf.sharding.device_set} == want


def _offline(params, prompts):
    graphdef, _ = _model(0)
    dec = SlotDecoder(test(), graphdef, jax.device_put(params, jax.devices()[0]),
                      DecoderConfig(2, (64,), (16,), "none"), warm_up=False, progress=False)
    results, _ = generate_many(dec, [DecodeRequest(tuple(TOK.encode(p)), 16, 16, TAU) for p in prompts])
    return [r.answer for r in results]


def _generate(srv, prompts):
    with srv.client() as c:
        return [list(c.generate(p, max_new_tokens=16, block_length=16, tau_min=TAU, tau_max=TAU).token_ids)
                for p in prompts]


def test_update_weights_under_load_swaps_without_failures_or_compiling(server):
    compiled = server.cluster.engines[0].runner.compiled
    before = compiled.compile_count
    _, old = _model(0)
    _, new = _model(1)
    replies, errors = {}, []

    def call(i):
        try:
            with server.client() as c:
                replies[i] = c.generate(PROMPTS[i % len(PROMPTS)], max_new_tokens=16, block_length=16,
                                        tau_min=TAU, tau_max=TAU)
        except grpc.RpcError as err:
            errors.append((i, err.code(), err.details()))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    pushes = []
    for version in (new, old, new):  # three swaps while the calls run
        pushed = _fsdp(version)
        pushes.append(server.update_weights(pushed))
        # the caller may donate its params at once: the copies were enqueued before
        jax.jit(lambda p: jax.tree.map(lambda x: x * 0 + 7, p), donate_argnums=0)(pushed)
    reports = [f.result(120) for f in pushes]
    for t in threads:
        t.join(300)
    assert errors == [] and len(replies) == 24
    assert all(r.finish_reason in (1, 2) for r in replies.values())
    assert [r.label for r in reports] == [f"memory:push {k}" for k in range(1, 4)]
    assert all(set(r.swapped_at) == {"tp2@4-5", "tp2@6-7"} for r in reports)
    assert compiled.compile_count == before  # same shardings and dtypes: every executable reused
    for params, _ in _served(server):  # the last push, not the 7s its source was overwritten with
        assert all(np.array_equal(a, b) for a, b in zip(_host(params), _host(new)))
    state = server.state()
    assert state["weight_updates"]["push"] >= 3 and state["model"] == "memory:push 3"

    after = _generate(server, PROMPTS)  # entirely after the swap: the new weights' tokens, exactly
    assert after == _offline(new, PROMPTS)
    assert after != _offline(old, PROMPTS)  # the check can tell the two weights apart


def test_push_from_training_devices_never_touches_host(server):
    _, params = _model(2)
    pushed = _fsdp(params)
    with _host_fetch_refused():
        report = server.update_weights(pushed).result(120)
    assert report.dispatch_seconds > 0 and report.copy_seconds >= 0
    for served, _ in _served(server):
        assert all(np.array_equal(a, b) for a, b in zip(_host(served), _host(params)))


def test_update_weights_rejects_another_architecture(server):
    other = nnx.split(init_model(test().replace(n_layers=1), seed=0))[1]
    with pytest.raises(IncompatibleWeights, match="tree structure"):
        server.update_weights(other)
    wide = nnx.split(init_model(test().replace(mlp_hidden=256), seed=0))[1]
    with pytest.raises(IncompatibleWeights, match="shape"):
        server.update_weights(wide)


def test_a_server_on_a_share_that_does_not_fit_the_mesh_says_so():
    graphdef, params = _model(0)
    with pytest.raises(ValueError, match=r"mesh 2x4 uses 8 device\(s\) but the device share \[4, 5, 6, 7\] has 4"):
        Server(graphdef, params, devices=jax.devices()[4:], mesh="2x4", port=0)


def test_a_push_after_a_reconfiguration_lands_on_the_new_instances(server):
    """The layout is read at each push: after reshaping 2x2 -> 1x4 (within devices 4-7) the weights
    go to the TP-4 instance, and back at 2x2 nothing compiles again."""
    report = server.cluster.reconfigure("1x4")
    assert [i["name"] for i in server.state()["instances"]] == ["tp4@4-7"] and report.added == ("tp4@4-7",)
    _, params = _model(3)
    pushed = server.update_weights(_fsdp(params)).result(120)
    assert set(pushed.swapped_at) == {"tp4@4-7"}
    (served, _), = _served(server)
    assert all(np.array_equal(a, b) for a, b in zip(_host(served), _host(params)))
    assert {d.id for leaf in jax.tree.leaves(served) for d in leaf.sharding.device_set} == {4, 5, 6, 7}
    assert _generate(server, PROMPTS[:4]) == _offline(params, PROMPTS[:4])
    compiled = server.cluster.builder.compiled
    before = compiled.compile_count
    server.cluster.reconfigure("2x2")
    _, again = _model(4)
    assert set(server.update_weights(_fsdp(again)).result(120).swapped_at) == {"tp2@4-5", "tp2@6-7"}
    assert compiled.compile_count == before
    for served, _ in _served(server):  # the 2x2 instances were rebuilt from the TP-4 copy, then pushed to
        assert all(np.array_equal(a, b) for a, b in zip(_host(served), _host(again)))
