"""Helpers shared by the mesh tests. A module name of its own: test folders without __init__.py
share one import namespace, where every "conftest" collides."""
import jax
import numpy as np


def host_copy(params) -> dict:
    """{path: numpy array} for bit-for-bit comparisons."""
    from dilaserve_jax.mesh.sharding import param_path

    return {param_path(kp): np.asarray(jax.device_get(leaf)) for kp, leaf in jax.tree_util.tree_leaves_with_path(params)}
