"""The soak benchmark end to end, small: a fault and a reload midway, and no call lost."""
import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_soak_loses_nothing(tmp_path):
    from dilaserve_jax.serving.cluster.fake_runner import fake_profile

    fake_profile().save(tmp_path / "profile.json")  # skip the start-up measurement: answers do not depend on it
    out = subprocess.run([sys.executable, "-m", "dilaserve_jax.bench.soak", "--requests", "60", "--concurrency", "16",
                          "--mesh", "2x1", "--slots", "4", "--compile-cache", str(tmp_path / "xla"), "--json",
                          "--profile", str(tmp_path / "profile.json")],
                         capture_output=True, text=True, timeout=600,
                         env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})  # it presents its own
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["lost"] == 0 and report["calls"] == 60
    assert report["completed"] + report["rejected_by_design"] + report["cancelled"] == 60
    assert report["completed"] > 30 and report["reloads"] == 1
    assert list(report["failures"]) == ["tp1@0"]
