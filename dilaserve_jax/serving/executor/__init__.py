"""The JAX executor: the runner over `decoding/`, building instances on a layout, measuring
latency profiles and pushing weights. The only serving layer that imports JAX."""
