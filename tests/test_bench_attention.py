"""bench.attention --sharded end to end on the 8 fake CPU devices (interpret mode, tiny shapes)."""
import json

from dilaserve_jax.bench import attention as bench


def test_sharded_check_runs_end_to_end(capsys):
    argv = ["--sharded", "--check", "--json", "--tp", "1", "4", "--heads", "8", "--kv-heads", "2", "--head-dim", "16",
            "--canvas", "32", "--queries", "8", "--iters", "1", "--dtype", "float32"]
    assert bench.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert "interpret mode" in report["note"]
    rows = {(r["impl"], r["tp"]): r for r in report["rows"]}
    assert set(rows) == {("pallas", 1), ("xla", 1), ("pallas", 4), ("xla", 4)}
    tp4 = rows["pallas", 4]  # 2 kv heads < TP 4: K/V replicated, the kernel reads one kv head per device
    assert (tp4["q_per_device"], tp4["kv_per_device"], tp4["kernel_kv"]) == ("2x8x2x16", "2x32x2x16", "2x32x1x16")
    assert all(r["collectives"] == "none" and "ms" in r for r in rows.values())
    assert rows["pallas", 1]["matches_xla"] and tp4["matches_xla"] and tp4["max_abs_err_vs_xla"] < 1e-5


def test_check_fails_on_a_row_that_cannot_run(capsys):
    argv = ["--sharded", "--check", "--tp", "4", "--heads", "6", "--kv-heads", "6", "--head-dim", "16",
            "--canvas", "32", "--queries", "8", "--iters", "1"]
    assert bench.main(argv) == 1  # TP 4 does not divide 6 heads
    assert "does not divide the 6 attention heads" in capsys.readouterr().err
