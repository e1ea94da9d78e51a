import json
import subprocess
import sys


def _run(*args):
    return subprocess.run([sys.executable, "-m", "dilaserve_jax.generate", *args], capture_output=True, text=True, timeout=300)


def test_generate_runs_the_test_preset():
    out = _run("--model", "test", "--gen-length", "16", "--block-length", "8", "--json", "hello")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["steps"] == 16 and sum(result["committed_per_step"]) == 16
    assert result["model"].startswith("preset:test")


def test_generate_reports_bad_input_clearly():
    out = _run("--model", "test", "--threshold", "1.5", "hi")
    assert out.returncode == 2 and "threshold must be in (0, 1]" in out.stderr
    out = _run("--model", "no-such-model", "hi")
    assert out.returncode == 2 and "neither a preset" in out.stderr
