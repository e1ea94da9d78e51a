"""Device meshes: specs ("2x4", "4+2+1+1"), layouts of instances, the sharding table, placement,
live resharding and multi-host start-up."""
from dilaserve_jax.core.layouts import MODEL_AXIS
from dilaserve_jax.mesh.layout import Instance, Layout
from dilaserve_jax.mesh.placement import (abstract_sharded_params, host_placer, load_into_layout, place_params,
                                          replicate_to_instances)
from dilaserve_jax.mesh.reshard import ReshardReport, reshard
from dilaserve_jax.mesh.sharding import (SHARDING_RULES, kv_cache_partition_spec, kv_cache_sharding, param_shardings,
                                         partition_spec, sharding_table)
from dilaserve_jax.mesh.spec import MeshSpec, MeshSpecError, check_model, check_model_tp

__all__ = [
    "Instance", "Layout", "MODEL_AXIS", "MeshSpec", "MeshSpecError", "ReshardReport", "SHARDING_RULES",
    "abstract_sharded_params", "check_model", "check_model_tp", "host_placer", "kv_cache_partition_spec",
    "kv_cache_sharding", "load_into_layout", "param_shardings", "partition_spec", "place_params",
    "replicate_to_instances", "reshard", "sharding_table",
]
