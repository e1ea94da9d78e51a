"""Which placements the real builder reports as compiled (what a switch is priced with)."""
from types import SimpleNamespace

from dilaserve_jax.serving.executor import instances
from dilaserve_jax.serving.executor.instances import JaxInstanceBuilder


def _builder(warmed):
    b = object.__new__(JaxInstanceBuilder)  # only the parts compiled_placements reads
    b._warmed = set(warmed)
    b.layout = SimpleNamespace(devices=list(range(8)))
    return b


def test_per_placement_backends_report_only_what_they_built(monkeypatch):
    monkeypatch.setattr(instances, "executables_shared_by_degree", lambda: False)
    assert _builder({(4, 0), (1, 0)}).compiled_placements() == {(4, 0), (1, 0)}


def test_a_gpu_compile_cache_makes_a_compiled_degree_ready_at_every_placement(monkeypatch):
    monkeypatch.setattr(instances, "executables_shared_by_degree", lambda: True)
    got = _builder({(4, 0), (1, 0)}).compiled_placements()
    assert got == {(4, 0), (4, 4)} | {(1, d) for d in range(8)}
    assert (2, 0) not in got  # a degree never compiled still compiles


def test_this_cpu_backend_does_not_share_executables_across_devices():
    assert not instances.executables_shared_by_degree()
