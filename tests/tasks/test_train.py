"""The masked-diffusion objective and the training command (test preset, tiny batches)."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dilaserve_jax.models.config import test as test_preset
from dilaserve_jax.models.llada import init_model
from dilaserve_jax.tasks.data import collate
from dilaserve_jax.tasks.objective import diffusion_loss, make_optimizer, make_train_step, mask_batch
from dilaserve_jax.tasks.suite import training_examples
from dilaserve_jax.tasks.train import TrainConfig, main


def _batch(rows=8):
    examples = [x for x, _ in zip(training_examples(seed=0, tasks=("sort", "repeat")), range(rows))]
    return collate(examples, seq_len=48)


def test_masking_never_touches_the_prompt_or_padding():
    b = _batch()
    noisy, masked, p_mask = mask_batch(jax.random.key(0), jnp.asarray(b.tokens), jnp.asarray(b.answer_mask),
                                       mask_id=2, eps=1e-3)
    masked = np.asarray(masked)
    assert not masked[~b.answer_mask].any() and masked.any()
    assert np.array_equal(np.asarray(noisy)[~masked], b.tokens[~masked])
    assert (np.asarray(noisy)[masked] == 2).all()
    p = np.asarray(p_mask)
    assert ((p >= 1e-3) & (p <= 1.0)).all() and (p == p[:, :1]).all()  # one t per row


@pytest.mark.slow  # ~5-20 s on 2 CPU cores (two compilations)
def test_train_steps_lower_the_loss_on_a_fixed_batch():
    cfg = test_preset()
    graphdef, params = nnx.split(init_model(cfg, 0))
    b = _batch()
    args = (jnp.asarray(b.tokens), jnp.asarray(b.answer_mask), jnp.asarray(b.valid_len))
    key = jax.random.key(1)

    def loss(p):
        return float(diffusion_loss(p, graphdef, key, *args, mask_id=cfg.mask_id, eps=1e-3))

    before = loss(params)
    opt = make_optimizer(3e-3, steps=20, warmup=1, weight_decay=0.0, clip=1.0)
    step = make_train_step(graphdef, opt, mask_id=cfg.mask_id, eps=1e-3)
    opt_state = opt.init(params)
    for _ in range(5):
        params, opt_state, _ = step(params, opt_state, key, *args)
    after = loss(params)
    assert np.isfinite(after) and after < before - 0.1


def test_train_config_validates():
    with pytest.raises(ValueError):
        TrainConfig(out="x", steps=0)
    with pytest.raises(ValueError):
        TrainConfig(out="x", weights={"nope": 1.0})


@pytest.mark.slow
def test_train_command_checkpoints_resumes_and_exports(tmp_path, capsys):
    from dilaserve_jax.models import load_model

    out, export = tmp_path / "run", tmp_path / "export"
    common = ["--out", str(out), "--model", "test", "--batch-tokens", "384", "--checkpoint-every", "1",
              "--weights", '{"sort": 1}', "--no-progress"]
    assert main(common + ["--steps", "1"]) == 0
    assert main(common + ["--steps", "2", "--export", str(export)]) == 0  # resumes at step 1
    record = json.loads((export / "TRAINING.json").read_text())
    assert record["steps"] == 2 and record["resumed_from"] == 1 and np.isfinite(record["final_loss"])
    assert "python -m dilaserve_jax.tasks.train" in record["command"] and (export / "TRAINING.md").exists()
    assert load_model(out).source.endswith("@2")  # the serving reload path: model_config.json + orbax steps
    exported = load_model(export)
    assert exported.config.n_layers == test_preset().n_layers
    again = tmp_path / "again"
    assert main(common + ["--steps", "2", "--export", str(again), "--export-only"]) == 0  # no training
    assert json.loads((again / "TRAINING.json").read_text())["steps"] == 2
    assert main(common + ["--export-only"]) == 2  # needs --export
