"""bench.step_profile: stage attribution of HLO instructions and trace events, and a real profile."""
import numpy as np
import pytest

from dilaserve_jax.core.kinds import StepKind
from dilaserve_jax.bench.step_profile import (OP_KINDS, OTHER, _exclusive_by_name, _what, hlo_op_names,
                                              hlo_result_shapes, hlo_stages, op_kind, stage_profile, time_step_parts)
from dilaserve_jax.decoding.decoder import DecoderConfig, SlotDecoder
from dilaserve_jax.decoding.steps import STAGES
from dilaserve_jax.models import load_model

HLO = """
  %gather_fusion.3 = f32[2,8]{1,0} fusion(%p0, %p1), kind=kLoop, calls=%fc.1, metadata={op_name="jit(fn)/state_gather/jit(_take)/gather" stack_frame_id=9}
  %ynn_fusion.2 = f32[4,8]{1,0} fusion(%a, %b), kind=kCustom, metadata={op_name="jit(fn)/layers/proposal_like/dot_general"}
  ROOT %tuple.1 = (f32[2]) tuple(%x), metadata={op_name="jit(fn)/commit/reduce"}
  %copy.7 = s32[] copy(%y), metadata={op_name="jit(fn)/while/body"}
"""


def test_hlo_instructions_take_the_innermost_named_stage():
    stages = hlo_stages(HLO)
    assert stages == {"gather_fusion.3": "state_gather", "ynn_fusion.2": "layers", "tuple.1": "commit",
                      "copy.7": OTHER}


def test_op_names_and_what_an_operation_computes():
    names = hlo_op_names(HLO)
    assert names["ynn_fusion.2"] == "jit(fn)/layers/proposal_like/dot_general"
    assert _what(names["ynn_fusion.2"]) == "proposal_like/dot_general"
    assert _what("jit(fn)/layers/while/body/closed_call/bqkgd,blkd->bkgql/dot_general") == \
        "bqkgd,blkd->bkgql/dot_general"
    assert _what("jit(fn)/commit") == "jit(fn)/commit"  # nothing past the stage: the whole name
    assert hlo_result_shapes(HLO) == {"gather_fusion.3": "f32[2,8]", "ynn_fusion.2": "f32[4,8]", "copy.7": "s32[]"}


def test_op_kinds_from_instruction_names():
    assert [op_kind(n) for n in ("ynn_fusion.41", "transpose_copy_fusion.3", "wrapped_scatter.2", "gather_bitcast_fusion",
                                 "multiply_bitcast_fusion.12", "exponential_fusion", "dot.4")] == \
        ["matmul", "data_movement", "data_movement", "data_movement", "elementwise", "elementwise", "matmul"]


def test_nested_trace_events_count_their_exclusive_time_once():
    events = [  # thread 1: a while loop (10 µs) holding two ops (3 + 2 µs); thread 2: one op
        {"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 10, "name": "while.1"},
        {"ph": "X", "pid": 1, "tid": 1, "ts": 1, "dur": 3, "name": "op.a"},
        {"ph": "X", "pid": 1, "tid": 1, "ts": 5, "dur": 2, "name": "op.b"},
        {"ph": "X", "pid": 1, "tid": 2, "ts": 2, "dur": 4, "name": "op.a"},
        {"ph": "M", "pid": 1, "tid": 2, "name": "thread_name"},
    ]
    assert _exclusive_by_name(events) == {"while.1": 5, "op.a": 7, "op.b": 2}


@pytest.fixture(scope="module")
def decoder_after_refresh():
    m = load_model("test")
    dec = SlotDecoder(m.config, m.graphdef, m.params, DecoderConfig(2, (32,), (8,), "dual"),
                      warm_up=False, progress=False)
    for slot in range(2):
        dec.admit(slot, [5, 6, 7, 8], 28, 8)
    dec.step(StepKind.REFRESH, [0, 1], [1.0, 1.0])
    return dec


@pytest.mark.slow
def test_step_timing_and_stage_profile_of_a_real_step(decoder_after_refresh):
    dec = decoder_after_refresh
    parts = time_step_parts(dec, False, [0, 1], repeats=2)
    assert parts["step_ms"] > 0 and parts["compiled_ms"] > 0 and parts["result_copy_ms"] > 0
    # the host's part of each step, measured inside it: positive and a fraction of the step
    assert 0 < parts["outside_min_ms"] <= parts["outside_ms"] < parts["step_ms"]
    assert "get" not in vars(dec.compiled)  # the timing wrapper is gone again
    assert parts["step_min_ms"] <= parts["step_ms"] and parts["compiled_min_ms"] <= parts["compiled_ms"]
    # averaged over 3 steps: one step's figure can carry a whole preemption of the machine's threads
    profile = stage_profile(dec, False, [0, 1], repeats=3)
    busy = profile["busy_ms"]
    assert set(busy) == {*STAGES, OTHER}
    assert busy["layers"] > 0 and busy["layers"] == max(busy.values())  # the model dominates a step
    assert set(profile["kind_busy_ms"]) == set(OP_KINDS) and profile["kind_busy_ms"]["matmul"] > 0
    assert sum(profile["kind_busy_ms"].values()) == pytest.approx(sum(busy.values()))
    assert profile["flops"] > 0 and profile["bytes_accessed"] > 0
    assert np.isfinite(list(busy.values())).all()
    assert profile["top_ops"] == []  # none asked for
    top = stage_profile(dec, False, [0, 1], repeats=1, top_ops=3)["top_ops"]
    assert len(top) == 3 and [op["busy_ms"] for op in top] == sorted((op["busy_ms"] for op in top), reverse=True)
    assert all(op["stage"] in (*STAGES, OTHER) and op["kind"] in OP_KINDS and op["what"] for op in top)
    assert top[0]["busy_ms"] > 0


@pytest.mark.slow
def test_a_slot_sharded_step_is_timed_and_counted_over_both_shards(decoder_after_refresh):
    one = decoder_after_refresh
    m = load_model("test")
    dec = SlotDecoder(m.config, m.graphdef, m.params, DecoderConfig(2, (32,), (8,), "dual", slot_shards=2),
                      warm_up=False, progress=False)
    for slot in range(2):
        dec.admit(slot, [5, 6, 7, 8], 28, 8)
    dec.step(StepKind.REFRESH, [0, 1], [1.0, 1.0])
    parts = time_step_parts(dec, False, [0, 1], repeats=1)  # arguments land split by shard, as compiled
    assert 0 < parts["outside_ms"] < parts["step_ms"]
    flops = stage_profile(dec, False, [0, 1], repeats=1)["flops"]
    assert flops == pytest.approx(stage_profile(one, False, [0, 1], repeats=1)["flops"], rel=0.05)
