"""Workloads: the trace format, arrival processes, the token-count mapping, SLO specs."""
import numpy as np
import pytest

from dilaserve_jax.sim.workload import (TinyShapes, arrival_times, build_shapes, llada_shape, load_trace, parse_slo)


def _csv(tmp_path, rows):
    p = tmp_path / "t.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(f"{t},{c},{g}\n" for t, c, g in rows))
    return p


def test_trace_is_read_relative_and_sorted_and_scaled(tmp_path):
    p = _csv(tmp_path, [("2023-11-16 18:17:05.5000000", 10, 3), ("2023-11-16 18:17:03.9799600", 4808, 10),
                        ("2023-11-16 18:17:04.0319600", 3180, 8)])
    tr = load_trace(p)
    assert tr.times.tolist() == pytest.approx([0.0, 0.052, 1.52004])
    assert tr.context.tolist() == [4808, 3180, 10] and tr.generated.tolist() == [10, 8, 3]
    rng = np.random.default_rng(0)
    assert arrival_times(str(p), duration=None, rate_scale=2.0, rng=rng, trace=tr).tolist() == pytest.approx(
        [0.0, 0.026, 0.76002])
    assert arrival_times(str(p), duration=0.5, rate_scale=1.0, rng=rng, trace=tr).tolist() == pytest.approx([0.0, 0.052])
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="columns"):
        load_trace(bad)
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "nope.csv")


def test_arrival_processes_have_their_rates_and_burstiness():
    rng = np.random.default_rng(1)
    p = arrival_times("poisson:20", duration=500, rate_scale=1.0, rng=rng)
    assert len(p) / 500 == pytest.approx(20, rel=0.05) and (np.diff(p) > 0).all()
    assert len(arrival_times("poisson:20", duration=500, rate_scale=0.5, rng=rng)) / 500 == pytest.approx(10, rel=0.06)
    b = arrival_times("bursty:20:4", duration=2000, rate_scale=1.0, rng=rng)
    gaps = np.diff(b)
    assert len(b) / 2000 == pytest.approx(20, rel=0.2) and gaps.std() / gaps.mean() > 2.5
    d = arrival_times("diurnal:20:100:0.8", duration=1000, rate_scale=1.0, rng=rng)
    counts = np.bincount((d % 100 // 25).astype(int), minlength=4)  # quarters of the period
    assert counts[0] > 2 * counts[2]  # the sine's high quarter against its low one
    for bad in ("poisson:0", "poisson", "bursty:5:-1", "diurnal:5:0", "uniform:5"):
        with pytest.raises(ValueError):
            arrival_times(bad, duration=10, rate_scale=1.0, rng=rng)
    with pytest.raises(ValueError, match="duration"):
        arrival_times("poisson:5", duration=None, rate_scale=1.0, rng=rng)


def test_trace_token_counts_map_to_llada_requests():
    s = llada_shape(1469, 13)
    assert (s.prompt_len, s.answer_length, s.block_length, s.finish_tokens) == (1469, 32, 32, 14)
    s = llada_shape(7437, 250)  # prompt cut to leave room for the answer area in 4096 tokens
    assert s.answer_length == 256 and s.finish_tokens == 251 and s.prompt_len == 4096 - 256
    s = llada_shape(100, 1899, max_answer=1024)
    assert s.answer_length == 1024 and s.finish_tokens == 1024


def test_tiny_shapes_follow_the_trace_answer_length_and_the_suite():
    tiny = TinyShapes(per_task=3, seed=0)
    rng = np.random.default_rng(0)
    short = [tiny.draw(rng, 5) for _ in range(20)]
    long = [tiny.draw(rng, 200) for _ in range(20)]
    assert {s.task for s in short} <= {"sort", "repeat"} and {s.task for s in long} <= {"upper", "altcase"}
    assert all(s.answer_length == 12 and s.block_length == 12 for s in short)
    assert all(s.answer_length == 96 and s.block_length == 32 for s in long)
    assert all(s.prompt_tokens == tuple(ord(c) for c in s.problem.prompt) for s in short + long)
    shapes = build_shapes("tiny", 8, rng, trace=None, from_trace_rows=False, tiny=tiny)
    assert len(shapes) == 8


def test_slo_specs():
    assert parse_slo("idle:2,6") == ("idle", (2.0, 6.0))
    assert parse_slo("idle") == ("idle", (2.0, 6.0))
    assert parse_slo("fixed:1.5") == ("fixed", (1.5,))
    for bad in ("idle:6,2", "fixed:0", "fixed", "deadline:3", "idle:x"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_steps_arrivals_hold_each_rate_for_its_seconds_and_repeat():
    from dilaserve_jax.sim.workload import is_synthetic, parse_steps, step_rate

    assert parse_steps("steps:20@300,90@300,20@300") == [(20.0, 300.0), (90.0, 300.0), (20.0, 300.0)]
    assert is_synthetic("steps:5@10")
    rng = np.random.default_rng(3)
    t = arrival_times("steps:20@100,90@50,0@20,20@100", duration=None, rate_scale=1.0, rng=rng)
    assert t.max() < 270 and (np.diff(t) >= 0).all()
    per = [((t >= a) & (t < b)).sum() / (b - a) for a, b in ((0, 100), (100, 150), (150, 170), (170, 270))]
    assert per[0] == pytest.approx(20, rel=0.15) and per[1] == pytest.approx(90, rel=0.1)
    assert per[2] == 0 and per[3] == pytest.approx(20, rel=0.15)
    assert [step_rate([(20, 100), (90, 50)], x) for x in (0, 99.9, 100, 149, 150, 260)] == [20, 20, 90, 90, 20, 90]
    # a longer --duration repeats the pattern, a shorter one cuts it; --rate-scale multiplies every rate
    t = arrival_times("steps:10@50,60@50", duration=300, rate_scale=0.5, rng=rng)
    assert ((t >= 250) & (t < 300)).sum() / 50 == pytest.approx(30, rel=0.2) and t.max() < 300
    assert arrival_times("steps:10@50,60@50", duration=40, rate_scale=1.0, rng=rng).max() < 40
    for bad in ("steps:", "steps:20", "steps:20@", "steps:20@0", "steps:-1@10", "steps:a@10", "steps:20@10,,5@3",
                "steps:0@10,0@5", "steps:20@10;90@10"):
        with pytest.raises(ValueError, match="steps:RATE@SECONDS"):
            arrival_times(bad, duration=None, rate_scale=1.0, rng=rng)


def test_diurnal_spans_its_range_and_a_short_trace_repeats(tmp_path):
    rng = np.random.default_rng(4)
    d = arrival_times("diurnal:55:1200:0.818", duration=1200, rate_scale=1.0, rng=rng)
    peak = ((d >= 240) & (d < 360)).sum() / 120  # around 300 s: 55 * 1.818 = 100
    trough = ((d >= 840) & (d < 960)).sum() / 120  # around 900 s: 55 * 0.182 = 10
    assert peak == pytest.approx(99, rel=0.08) and trough == pytest.approx(10.5, rel=0.3)
    p = _csv(tmp_path, [(0.0, 10, 3), (1.0, 20, 4), (3.0, 30, 5)])
    tr = load_trace(p)
    t = arrival_times(str(p), duration=9.0, rate_scale=1.0, rng=rng, trace=tr)
    assert t.tolist() == pytest.approx([0, 1, 3, 4.5, 5.5, 7.5])  # one mean gap (1.5 s) between copies
    shapes = build_shapes("llada_8b", len(t), rng, trace=tr, from_trace_rows=True)
    assert [s.prompt_len for s in shapes] == [10, 20, 30, 10, 20, 30]
