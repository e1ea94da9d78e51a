"""Start-up latency models: every TP degree is covered before the cluster serves, no measurement
runs on a serving instance's devices, and a warm start reads the profile cache instead."""
import dataclasses
import json

import pytest

from dilaserve_jax.core.kinds import StepKind
from dilaserve_jax.models.config import test as test_config
from dilaserve_jax.serving.cluster.fake_runner import fake_profile, tp_step_time
from dilaserve_jax.serving.executor.profile_cache import (DEFAULT_PROFILE_CACHE, ProfileCache, ProfileKey,
                                                          model_identity, profile_cache_dir)

KEY = ProfileKey("test", model_identity("preset:test", test_config()), "cpu:cpu", 2, (64, 128), (32,), (1, 2, 4),
                 "dual", "jax 0.0, format 1")


@pytest.mark.parametrize("change", [
    dict(lengths=(64, 256)), dict(blocks=(16, 32)), dict(batches=(1, 2)), dict(cache_mode="none"), dict(tp=4),
    dict(device="gpu:NVIDIA H200"), dict(model="tiny"), dict(runtime="jax 0.0, format 2"),
    dict(model_id=model_identity("preset:test", test_config().replace(n_layers=3))),
    dict(model_id=model_identity("/ckpt/other", test_config())),
])
def test_the_key_changes_with_the_shapes_model_and_devices(change, tmp_path):
    other = dataclasses.replace(KEY, **change)
    assert other.digest() != KEY.digest() and other.file_name() != KEY.file_name()
    cache = ProfileCache(tmp_path)
    cache.save(KEY, fake_profile())
    assert cache.load(other) is None and cache.load(KEY) == fake_profile()


def test_the_cache_ignores_foreign_and_corrupt_files(tmp_path):
    cache = ProfileCache(tmp_path / "profiles")
    assert cache.load(KEY) is None
    path = cache.save(KEY, fake_profile())
    data = json.loads(path.read_text())
    data["key"]["tp"] = 8  # a file whose key is not the one asked for, under its name
    path.write_text(json.dumps(data))
    assert cache.load(KEY) is None
    path.write_text("{not json")
    assert cache.load(KEY) is None
    assert cache.save(KEY, fake_profile()) == path and cache.load(KEY) == fake_profile()
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert ProfileCache(blocked / "sub").save(KEY, fake_profile()) is None  # logged, never raised


def test_the_cache_lives_beside_the_compile_cache_unless_told(tmp_path):
    assert profile_cache_dir(None, str(tmp_path / "xla")) == str(tmp_path / "latency-profiles")
    assert profile_cache_dir(None, "none") == DEFAULT_PROFILE_CACHE
    assert profile_cache_dir(str(tmp_path / "mine"), str(tmp_path / "xla")) == str(tmp_path / "mine")
    assert profile_cache_dir("none", str(tmp_path / "xla")) is None


class RecordingProfiler:
    """Stands in for measure_profile: records where it runs and whether anything served there."""

    def __init__(self):
        self.cluster = None
        self.calls = []  # (tp, device ids, serving instances on those devices)

    def __call__(self, runner, *, batches, lengths, blocks, repeats, progress):
        ids = {d.id for d in runner.decoder.devices}
        accepting = self.cluster.refusal() is None
        serving = [e.name for e in self.cluster.engines
                   if accepting and e.healthy and ids & {d.id for d in e.runner.decoder.devices}]
        self.calls.append((runner.tp_degree, tuple(sorted(ids)), serving))
        return fake_profile(tp_step_time(runner.tp_degree), batches=batches, canvases=lengths, blocks=blocks,
                            tp=runner.tp_degree)


def _cluster(cache_dir, profiler):
    from dilaserve_jax.serving.executor.build import ServeConfig, build_cluster

    cfg = ServeConfig(model="test", mesh="2x1", devices=(6, 7), slots=1, length_buckets=(32,), block_buckets=(8,),
                      default_block_length=8, default_max_new_tokens=8, controller="paused", step_timeout_s=None,
                      profile_cache=str(cache_dir))
    cluster = build_cluster(cfg, say=lambda _m: None, profiler=profiler)
    profiler.cluster = cluster
    return cluster


@pytest.mark.slow
def test_every_tp_degree_is_measured_before_serving_off_serving_devices_then_read_back(tmp_path):
    cold = RecordingProfiler()
    cluster = _cluster(tmp_path / "profiles", cold)
    try:
        cluster.start()
        cluster.warm_up()
        assert cluster.refusal() is None  # serving from here on
        # TP 1 on an instance of the layout, TP 2 on a temporary one over both devices: before serving
        assert sorted(tp for tp, _, _ in cold.calls) == [1, 2]
        assert all(not serving for _, _, serving in cold.calls), cold.calls
        assert (2, (6, 7), []) in cold.calls
        assert set(cluster.builder.latency) == {1, 2} and len(list((tmp_path / "profiles").iterdir())) == 2
        shapes = cluster.autoscaler.controller.shapes  # rounds priced as the decoders run them
        assert shapes.length_buckets == (32,) and shapes.batch_buckets == (1,)
        cluster.reconfigure("1x2")  # an instance prepared beside serving ones: nothing is measured
        assert len(cold.calls) == 2 and [e.scheduler.latency for e in cluster.engines] == \
            [cluster.builder.latency[2]]
    finally:
        cluster.stop()

    warm = RecordingProfiler()
    again = _cluster(tmp_path / "profiles", warm)
    try:
        again.start()
        again.warm_up()
        assert warm.calls == []  # read from the cache, not measured
        assert set(again.builder.latency) == {1, 2}
        for tp in (1, 2):
            assert again.builder.latency[tp].predict(StepKind.REFRESH, 1, 32, 8, tp) == \
                pytest.approx(cluster.builder.latency[tp].predict(StepKind.REFRESH, 1, 32, 8, tp))
    finally:
        again.stop()


def test_the_controller_prices_rounds_with_the_decoders_buckets():
    """serve hands the controller the length and batch buckets its decoders compile, so a round is
    priced as one padded step per length bucket present (as the simulator's calibration does)."""
    from types import SimpleNamespace
    from dilaserve_jax.serving.executor.build import ServeConfig, step_shapes

    cfg = ServeConfig(slots=8)
    shapes = step_shapes(SimpleNamespace(cfg=cfg, lengths=(128, 256)))
    assert shapes.length_buckets == (128, 256)
    assert shapes.batch_buckets == (1, 2, 4, 8)
    six = step_shapes(SimpleNamespace(cfg=dataclasses.replace(cfg, slots=6), lengths=(256,)))
    assert six.batch_buckets[-1] >= 6 and six.length_buckets == (256,)
