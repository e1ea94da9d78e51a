"""bench.scaling: its configuration, the random checkpoint it decodes and the side-by-side driver."""
import numpy as np
import pytest

from dilaserve_jax.bench.scaling import OWN_TREE, SCALING_MODEL, ScalingConfig, format_scaling, run_scaling, write_checkpoint
from dilaserve_jax.models import load_model


def test_config_validation():
    with pytest.raises(ValueError):
        ScalingConfig(batches=(0,))
    with pytest.raises(ValueError):
        ScalingConfig(caches=("lru",))
    with pytest.raises(ValueError):
        ScalingConfig(prompt=400, answer=200)
    with pytest.raises(ValueError, match="breakdown"):
        ScalingConfig(block=8)
    ScalingConfig(block=8, breakdown_batches=())


def test_checkpoint_loads_as_written_and_never_proposes_eos(tmp_path):
    m = load_model(write_checkpoint(tmp_path / "ckpt"))
    assert m.config.replace(name=SCALING_MODEL.name) == SCALING_MODEL
    head = np.asarray(m.params["lm_head"]["kernel"][...])
    assert head.shape == (256, 512) and not head[:, SCALING_MODEL.eos_id].any() and head[:, 3].any()
    assert m.tokenizer.vocab_size == 512 and m.tokenizer.encode("t7 t300") == [7, 300]


def test_table_shows_both_trees_and_flags_different_tokens():
    row = {"cache": "dual", "batch": 8, "this": 400.0, "against": 200.0, "this_cpu": 300.0, "against_cpu": 250.0,
           "same_tokens": False}
    step = {"tree": "this", "cache": "dual", "batch": 8, "kind": "reuse", "step_ms": 10.0, "compiled_ms": 9.0,
            "outside_ms": 1.0, "step_min_ms": 8.0, "compiled_min_ms": 7.6, "outside_min_ms": 0.4, "result_copy_ms": 0.1, "busy_ms": {"layers": 8.0, "other": 1.0}, "flops": 2e9,
            "bytes_accessed": 2e8}
    table = format_scaling({"trees": {"this": "a", "against": "b"}, "rows": [row], "breakdown": [step],
                            "matmul_gflops": {256: 180.4, 32: 90.2}})
    line = table.splitlines()[2]
    assert "2.00x" in line and "NO" in line and "1.20x" in line
    [step_line] = [x for x in table.splitlines() if x.startswith("this ")]
    assert "10.0" in step_line and "5.0" in step_line  # outside = 10% (5% at the minima)
    assert step_line.split()[-1] == "263"  # 2 GFLOP over the fastest compiled 7.6 ms
    assert table.splitlines()[-1].split() == ["M=32:", "90", "M=256:", "180"]


def test_table_with_three_sides_gives_each_ratio_against_the_last():
    row = {"cache": "dual", "batch": 32, "this": 600.0, "shards": 750.0, "against": 500.0, "this_cpu": 300.0,
           "shards_cpu": 330.0, "against_cpu": 250.0, "same_tokens": True}
    table = format_scaling({"trees": {"this": "a", "shards": "a", "against": "b"}, "rows": [row], "breakdown": []})
    head, _, line = table.splitlines()[:3]
    assert "this/against" in head and "shards/against" in head
    assert line.split() == ["dual", "32", "600", "750", "500", "1.20x", "1.50x", "yes", "300", "330", "250",
                            "1.20x", "1.32x"]


def test_largest_operations_are_listed_under_the_steps_that_have_them():
    step = {"tree": "this", "cache": "dual", "batch": 32, "kind": "reuse", "step_ms": 60.0, "compiled_ms": 59.0,
            "outside_ms": 1.0, "step_min_ms": 58.0, "compiled_min_ms": 57.0, "outside_min_ms": 0.9,
            "result_copy_ms": 0.1, "busy_ms": {"layers": 50.0}, "flops": 8e9, "bytes_accessed": 5e8,
            "top_ops": [{"name": "ynn_fusion.34", "stage": "layers", "kind": "matmul", "busy_ms": 4.17,
                         "what": "dot_general"}]}
    lines = format_scaling({"trees": {"this": "a"}, "rows": [], "breakdown": [step, {**step, "top_ops": []}]})
    lines = lines.splitlines()
    at = lines.index("largest operations: this dual batch 32 reuse (busy ms per step, stage, kind, what)")
    assert lines[at + 1].split() == ["4.17", "layers", "matmul", "ynn_fusion.34", "dot_general"]
    assert sum(line.startswith("largest operations") for line in lines) == 1
    with pytest.raises(ValueError, match="top_ops"):
        ScalingConfig(top_ops=-1)


def test_a_side_left_out_of_a_cell_shows_a_dash():
    row = {"cache": "dual", "batch": 1, "this": 200.0, "procs": None, "against": 100.0, "this_cpu": 150.0,
           "procs_cpu": None, "against_cpu": 120.0, "same_tokens": True}
    table = format_scaling({"trees": {"this": "a", "procs": "a", "against": "b"}, "rows": [row], "breakdown": []})
    assert table.splitlines()[2].split() == ["dual", "1", "200", "-", "100", "2.00x", "-", "yes", "150", "-", "120",
                                             "1.25x", "-"]


def test_process_count_must_be_positive():
    with pytest.raises(ValueError, match="processes"):
        run_scaling(ScalingConfig(), {"this": OWN_TREE}, progress=False, processes=0)


@pytest.mark.slow
def test_every_side_of_one_tree_agrees_token_for_token(tmp_path):
    """One worker on one device, one with its slots split over 2 host devices (every worker then
    gets 2 devices) and two processes each decoding half of a cell: all commit the same tokens.
    Batch 1 is left out for the processes (2 does not divide it)."""
    cfg = ScalingConfig(batches=(1, 2), caches=("dual",), prompt=4, answer=16, block=16, repeats=1,
                        breakdown_batches=(1,))
    result = run_scaling(cfg, {"this": OWN_TREE, "again": OWN_TREE}, progress=False, checkpoint_dir=tmp_path,
                         slot_shards={"again": 2}, processes=2)
    assert list(result["trees"]) == ["this", "procs", "again"]  # the last side stays the reference
    assert result["slot_shards"] == {"this": 1, "again": 2, "procs": 1}
    one, two = result["rows"]
    assert [(r["cache"], r["batch"]) for r in result["rows"]] == [("dual", 1), ("dual", 2)]
    assert one["procs"] is None and one["procs_all"] == [] and two["procs"] > 0 and two["procs_cpu"] > 0
    assert all(r["same_tokens"] and r["this"] > 0 and r["again"] > 0 for r in result["rows"])
    kinds = {(b["tree"], b["kind"]) for b in result["breakdown"]}
    assert kinds == {(t, k) for t in ("this", "again") for k in ("refresh", "reuse")}  # none for procs
    assert set(result["matmul_gflops"]) == {16, 20, 2 * 16, 2 * 20} and min(result["matmul_gflops"].values()) > 0
