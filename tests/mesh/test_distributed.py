"""Multi-host flags, and two real JAX processes on loopback sharing a 2x4 layout."""
import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dilaserve_jax.mesh.distributed import DistributedConfig, add_distributed_args, distributed_config

WORKER = Path(__file__).with_name("distributed_worker.py")
REPO = Path(__file__).resolve().parents[2]


def _parse(*argv):
    return add_distributed_args(argparse.ArgumentParser()).parse_args(list(argv))


def test_flags():
    assert distributed_config(_parse()) is None
    cfg = distributed_config(_parse("--coordinator", "10.0.0.1:8476", "--num-processes", "4", "--process-id", "3"))
    assert cfg == DistributedConfig("10.0.0.1:8476", 4, 3, 300)
    with pytest.raises(ValueError, match="missing --num-processes, --process-id"):
        distributed_config(_parse("--coordinator", "h:1"))
    with pytest.raises(ValueError, match=r"--process-id must be in \[0, 2\), got 2"):
        distributed_config(_parse("--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"))
    with pytest.raises(ValueError, match="host:port"):
        distributed_config(_parse("--coordinator", "nohost", "--num-processes", "2", "--process-id", "0"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_share_a_2x4_layout(tmp_path):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    procs = []
    for rank in range(2):
        log = open(tmp_path / f"worker{rank}.log", "w+")
        cmd = [sys.executable, str(WORKER), "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
               "--process-id", str(rank), "--distributed-timeout", "60"]
        procs.append((subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        for proc, _ in procs:
            proc.wait(timeout=180)
    finally:  # never leave a worker behind, whatever happened
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    outputs = [(tmp_path / f"worker{rank}.log").read_text() for rank in range(2)]
    for (proc, _), out in zip(procs, outputs):
        assert proc.returncode == 0, out[-3000:]
    results = [json.loads(next(line for line in out.splitlines() if line.startswith("{"))) for out in outputs]
    # One TP-4 group per process, each of that process's own devices (ids are per-process ranges).
    assert [len(r["devices"]) for r in results] == [4, 4]
    assert results[0]["devices"] == [0, 1, 2, 3] and not set(results[0]["devices"]) & set(results[1]["devices"])
    assert all(r["local"] for r in results)
    assert [r["instance"] for r in results] == [0, 1]
    assert results[0]["argmax"] == results[1]["argmax"]  # same model, same answer on both hosts
    assert all(r["reshard_bytes"] > 0 for r in results)
