"""`serve --ray-address`: flags it refuses before connecting to anything."""
from dilaserve_jax.serve import main


def test_ray_address_and_jax_distributed_flags_are_refused_together():
    assert main(["--ray-address", "auto", "--coordinator", "127.0.0.1:1", "--num-processes", "2",
                 "--process-id", "0"]) == 2


def test_ray_address_refuses_the_checkpoint_watch(tmp_path):
    assert main(["--ray-address", "auto", "--watch-checkpoints", str(tmp_path)]) == 2
