"""Loading checkpoints straight into a layout's shards (HF safetensors and orbax)."""
import jax
import pytest
from mesh_support import host_copy

from dilaserve_jax.mesh import Layout, abstract_sharded_params, load_into_layout, param_shardings
from dilaserve_jax.models.checkpoint import save_params
from dilaserve_jax.models.hf import save_hf_checkpoint
from dilaserve_jax.models.registry import save_model_config


def _assert_in_layout(per_instance, layout, cfg, want):
    assert len(per_instance) == len(layout.instances)
    for inst, params in zip(layout.instances, per_instance):
        for leaf, sharding in zip(jax.tree_util.tree_leaves(params),
                                  jax.tree_util.tree_leaves(param_shardings(params, inst, cfg))):
            assert leaf.sharding == sharding
        got = host_copy(params)
        assert all(got[k].tobytes() == want[k].tobytes() for k in want)


def test_hf_checkpoint_lands_in_shards(tmp_path, monkeypatch, model, cfg):
    save_hf_checkpoint(tmp_path / "hf", cfg, model[1], max_shard_bytes=100_000)
    slices: dict[tuple, list] = {}
    real = jax.make_array_from_callback

    def recording(shape, sharding, callback, **kwargs):
        def sliced(index):
            part = callback(index)
            slices.setdefault(shape, []).append(part.size)
            return part
        return real(shape, sharding, sliced, **kwargs)

    monkeypatch.setattr(jax, "make_array_from_callback", recording)
    layout = Layout.build("2x4", config=cfg)
    loaded, per_instance = load_into_layout(tmp_path / "hf", layout)
    assert loaded.config.n_heads == 8 and loaded.source.startswith("hf:")
    _assert_in_layout(per_instance, layout, cfg, host_copy(model[1]))
    # Each device of the first instance was handed only its quarter of a split tensor, never the whole.
    q_shape = (cfg.d_model, cfg.n_heads * cfg.head_dim)
    assert set(slices[q_shape]) == {cfg.d_model * cfg.n_heads * cfg.head_dim // 4}


def test_orbax_checkpoint_restores_into_shards(tmp_path, model, cfg):
    save_params(tmp_path / "run", 7, model[1])
    save_model_config(tmp_path / "run", cfg)
    layout = Layout.build("4+2+1+1", config=cfg)
    loaded, per_instance = load_into_layout(tmp_path / "run", layout)
    assert loaded.source.endswith("@7")
    _assert_in_layout(per_instance, layout, cfg, host_copy(model[1]))


def test_abstract_sharded_params_carry_shardings(cfg):
    inst = Layout.build("1x8", config=cfg).instances[0]
    _, abstract = abstract_sharded_params(cfg, inst)
    leaves = jax.tree_util.tree_leaves(abstract)
    assert all(isinstance(a, jax.ShapeDtypeStruct) and a.sharding.mesh == inst.mesh for a in leaves)


def test_preset_into_layout_and_model_checks():
    layout = Layout.build("2x4")
    loaded, per_instance = load_into_layout("test", layout)  # 4 heads: TP 4 is fine
    assert per_instance[0] is loaded.params and len(per_instance) == 2
    with pytest.raises(ValueError, match="TP 8 does not divide the 4 attention heads"):
        load_into_layout("test", Layout.build("1x8"))
