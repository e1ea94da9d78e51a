"""dilaserve-jax: deadline-aware serving of diffusion language models on JAX device meshes."""
__version__ = "0.1.0"
