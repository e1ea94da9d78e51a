"""One process of the two-process test: 4 fake CPU devices, 2x4 layout over the 8 global devices,
one forward step on this process's instance, one local reshard. Prints a JSON line on success."""
import argparse
import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dilaserve_jax.mesh import Layout, load_into_layout, reshard  # noqa: E402
from dilaserve_jax.mesh.distributed import add_distributed_args, init_distributed  # noqa: E402


def main() -> None:
    args = add_distributed_args(argparse.ArgumentParser()).parse_args()
    config = init_distributed(args)
    assert jax.process_count() == 2 and len(jax.devices()) == 8 and len(jax.local_devices()) == 4
    layout = Layout.build("2x4")
    (mine,) = layout.local_instances()
    loaded, per_instance = load_into_layout("test", layout, seed=5)
    assert [p is None for p in per_instance] == [not inst.is_local for inst in layout.instances]
    from dilaserve_jax.decoding.reference import _logits

    canvas = jnp.asarray([5, 6, 7, 8] + [loaded.config.mask_id] * 4, dtype=jnp.int32)
    logits = _logits(loaded.graphdef, per_instance[mine.index], canvas)
    # The same model on one local device, as the reference.
    single = jax.device_put(per_instance[mine.index], jax.local_devices()[0])
    want = _logits(loaded.graphdef, single, canvas)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want), rtol=1e-5, atol=1e-5)
    new_layout = Layout.build("4x2")
    moved, report = reshard(per_instance, layout, new_layout, loaded.config)
    assert [p is None for p in moved] == [not inst.is_local for inst in new_layout.instances]
    print(json.dumps({"process": config.process_id, "instance": mine.index, "devices": list(mine.device_ids),
                      "local": set(mine.devices) == set(jax.local_devices()),
                      "argmax": np.asarray(logits).argmax(-1).tolist(), "reshard_bytes": report.bytes_moved}), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    sys.exit(main())
