"""dilaserve-jax: deadline-aware serving of diffusion language models on JAX device meshes."""
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "Server":  # imported on first use: `import dilaserve_jax` stays light (no JAX, no gRPC)
        from dilaserve_jax.server_api import Server

        return Server
    raise AttributeError(f"module 'dilaserve_jax' has no attribute {name!r}")


__all__ = ["Server"]
