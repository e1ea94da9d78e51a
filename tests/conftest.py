"""Test session set-up: 8 fake CPU devices (before JAX initialises) and accelerator markers."""
import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import pytest  # noqa: E402


def _backend() -> str:
    import jax

    return jax.default_backend()


def pytest_collection_modifyitems(config, items):
    backend = None
    for item in items:
        for marker, wanted in (("gpu", ("gpu", "cuda")), ("tpu", ("tpu",))):
            if marker in item.keywords:
                backend = backend or _backend()
                if backend not in wanted:
                    item.add_marker(pytest.mark.skip(reason=f"needs a {marker.upper()} (backend is {backend})"))
