"""The checkpoint watcher follows a directory written by the training command: new finalized steps
are swapped in, a half-written (temporary) step is never opened, a corrupt step is skipped while
the old weights keep serving; GetClusterState and the metrics show it."""
import json
import shutil
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from prometheus_client import generate_latest

from dilaserve_jax.frontend.metrics import ServingMetrics
from dilaserve_jax.frontend.service import DiLaServeService
from dilaserve_jax.models import load_model
from dilaserve_jax.models.checkpoint import save_params
from dilaserve_jax.models.registry import save_model_config
from dilaserve_jax.serving.executor.build import ServeConfig, build_cluster
from dilaserve_jax.serving.executor.checkpoint_watch import CheckpointWatcher, finalized_steps, served_step
from dilaserve_jax.serving.cluster.fake_runner import fake_profile
from dilaserve_jax.tasks.train import main as train_main

pytestmark = pytest.mark.slow


def _train(run: Path, steps: int) -> None:
    """The training command (resumes from the latest step in `run`), on the small `test` model."""
    argv = ["--out", str(run), "--model", "test", "--steps", str(steps), "--batch-tokens", "256",
            "--weights", json.dumps({"sort": 1}), "--checkpoint-every", "1", "--compute-dtype", "float32",
            "--lr", "0.01", "--warmup", "0", "--no-progress"]
    assert train_main(argv) == 0


def _save(run: Path, step: int) -> None:
    """A step written as the trainer writes its params (same orbax format), without training."""
    params = load_model(run, step=2).params
    save_params(run, step, jax.tree.map(lambda x: x * (1 + step / 100), params))


def _served(cluster):
    engine = cluster.engines[0]
    params = engine.call(lambda: engine.runner.decoder.params).result(30)
    return [np.asarray(jax.device_get(x)) for x in jax.tree.leaves(params)]


def _on_disk(run: Path, step: int):
    return [np.asarray(x) for x in jax.tree.leaves(load_model(run, step=step).params)]


def _same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.fixture
def watched(tmp_path):
    run = tmp_path / "run"
    _train(run, 1)
    profile = tmp_path / "profile.json"
    fake_profile().save(profile)
    cfg = ServeConfig(model=str(run), mesh="2", devices=(2, 3), slots=1, cache_mode="none", length_buckets=(64,),
                      block_buckets=(16,), default_block_length=16, profile=str(profile), step_timeout_s=None)
    cluster = build_cluster(cfg, say=lambda _m: None).start()  # swapping weights needs no compiled step
    watcher = CheckpointWatcher(cluster, run, interval_s=0.05, after_step=served_step(cluster.model_source, run))
    yield run, cluster, watcher
    watcher.stop()
    cluster.stop()


# orbax abandons the reads of the other arrays when the first damaged one fails; their coroutines
# are then collected unawaited, which pytest reports as unraisable (harmless: nothing was loaded)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_watcher_follows_training_and_skips_partial_and_corrupt_steps(watched):
    run, cluster, watcher = watched
    assert cluster.model_source.endswith("@1") and watcher.last_step == 1
    assert watcher.poll() is None and cluster.reloads == 0  # nothing new yet

    _train(run, 2)  # the training command writes step 2
    assert watcher.poll() == 2
    assert _same(_served(cluster), _on_disk(run, 2)) and not _same(_on_disk(run, 1), _on_disk(run, 2))

    # a step still being written: orbax keeps it under a temporary name until every file is in place
    partial = run / "9.orbax-checkpoint-tmp-1700000000000"
    shutil.copytree(run / "2", partial)
    (partial / "commit_success.txt").unlink()
    for f in (partial / "default" / "ocdbt.process_0" / "d").iterdir():
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    assert finalized_steps(run) == [1, 2]
    assert watcher.poll() is None and watcher.last_step == 2 and not watcher.skipped
    shutil.rmtree(partial)

    _save(run, 3)  # step 3 is finalized, then its array data is damaged on disk
    for f in (run / "3" / "default" / "ocdbt.process_0" / "d").iterdir():
        f.write_bytes(np.random.default_rng(0).bytes(64))
    assert watcher.poll() is None
    assert list(watcher.skipped) == [3] and "step 3" in watcher.last_error
    assert _same(_served(cluster), _on_disk(run, 2))  # the old weights keep serving
    assert all(e.healthy for e in cluster.engines)
    assert watcher.poll() is None and list(watcher.skipped) == [3]  # a skipped step is not retried

    _save(run, 4)
    watcher.start()  # the polling thread picks step 4 up on its own
    deadline = time.monotonic() + 60
    while watcher.last_step != 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert watcher.last_step == 4 and _same(_served(cluster), _on_disk(run, 4))

    state = DiLaServeService(cluster)._cluster_state()
    assert state.checkpoint_watch.directory == str(run) and state.checkpoint_watch.last_step == 4
    assert (state.checkpoint_watch.reloads, state.checkpoint_watch.skipped) == (2, 1)
    assert "step 3" in state.checkpoint_watch.last_error and state.weight_updates["watch"] == 2
    assert state.model.endswith("@4")
    text = generate_latest(ServingMetrics(cluster).registry).decode()
    assert "dilaserve_checkpoint_watch_step 4.0" in text
    assert "dilaserve_checkpoint_watch_reloads_total 2.0" in text
    assert "dilaserve_checkpoint_watch_skipped_total 1.0" in text
    assert 'dilaserve_weight_updates_total{origin="watch"} 2.0' in text


def test_watcher_loads_the_newest_step_when_serving_something_else(tmp_path):
    run = tmp_path / "run"
    model = load_model("test")
    save_model_config(run, model.config)
    for step in (1, 2):
        save_params(run, step, jax.tree.map(lambda x: x * step, model.params))
    cfg = ServeConfig(model="test", mesh="1", devices=(5,), slots=1, cache_mode="none", length_buckets=(64,),
                      block_buckets=(16,), default_block_length=16, step_timeout_s=None)
    cluster = build_cluster(cfg, say=lambda _m: None).start()
    try:
        watcher = CheckpointWatcher(cluster, run, after_step=served_step(cluster.model_source, run))
        assert watcher.last_step is None and watcher.status()["last_step"] == -1
        assert watcher.poll() == 2 and _same(_served(cluster), _on_disk(run, 2))
        missing = CheckpointWatcher(cluster, tmp_path / "not-yet")
        assert missing.poll() is None and missing.reloads == 0
    finally:
        cluster.stop()


def test_served_step_reads_the_start_up_source(tmp_path):
    assert served_step(f"orbax:{tmp_path}@7", tmp_path) == 7
    assert served_step(f"orbax:{tmp_path}/other@7", tmp_path) is None
    assert served_step("hf:/somewhere", tmp_path) is None
    with pytest.raises(ValueError, match="positive"):
        CheckpointWatcher(None, tmp_path, interval_s=0)
