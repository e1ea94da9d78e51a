"""Fake-runner fixtures shared by the serving tests (no JAX); helpers live in serving_support.py."""
import pytest

from dilaserve_jax.serving.cluster.fake_runner import fake_profile
from dilaserve_jax.serving.policy.latency import LatencyModel


@pytest.fixture(scope="session")
def latency():
    return LatencyModel.from_profile(fake_profile())
