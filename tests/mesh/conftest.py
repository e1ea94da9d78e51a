"""Shared fixtures for the mesh tests: a test-sized model whose 8 heads allow TP up to 8."""
import jax
import pytest
from flax import nnx

from dilaserve_jax.models import config
from dilaserve_jax.models.llada import init_model


def tp8_config(n_kv_heads: int = 2):
    """The `test` preset widened to 8 heads (head_dim 8 keeps d_model 64). With 2 kv heads, TP 1-2 shard
    the kv heads and TP 4-8 take the GQA replication path."""
    return config.test().replace(n_heads=8, n_kv_heads=n_kv_heads, head_dim=8, mlp_hidden=128)


@pytest.fixture(scope="session")
def cfg():
    return tp8_config()


@pytest.fixture(scope="session")
def model(cfg):
    """(graphdef, params on the default device)."""
    assert len(jax.devices()) == 8, "the mesh tests need 8 fake CPU devices (tests/conftest.py sets XLA_FLAGS)"
    return nnx.split(init_model(cfg, seed=3))
