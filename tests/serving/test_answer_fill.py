"""How much of its last block a request decodes: the estimate, what an instance publishes, and what
the cluster controller's capacity model does with it."""
import dataclasses

import numpy as np
import pytest

from serving_support import make_engine, req
from dilaserve_jax.core.kinds import StepKind
from dilaserve_jax.serving.cluster.fake_runner import FakeRunner
from dilaserve_jax.serving.policy.answer_fill import LastBlockFill, pooled_fill
from dilaserve_jax.serving.policy.capacity import RequestShape, service_times


def test_the_fill_is_the_share_of_the_last_block_decoded_over_a_window():
    fill = LastBlockFill(window=2)
    assert fill.mean == 1.0 and fill.count == 0  # the prior: a full last block
    fill.observe(committed=52, answer_length=64, block_length=16)  # 4 of the last block's 16
    assert fill.mean == 0.25
    fill.observe(committed=64, answer_length=64, block_length=16)
    assert fill.mean == pytest.approx(0.625)
    fill.observe(committed=8, answer_length=16, block_length=16)  # the first one leaves the window
    assert fill.count == 2 and fill.mean == pytest.approx(0.75)
    fill.observe(committed=0, answer_length=16, block_length=16)  # at least one position a block
    assert fill.mean == pytest.approx((0.5 + 1 / 16) / 2)


def test_instances_are_pooled_by_how_many_requests_each_saw():
    # a generator, as the autoscaler passes it: read once
    assert pooled_fill(x for x in [(0.5, 3), (1.0, 1), (0.2, 0)]) == pytest.approx(0.625)
    assert pooled_fill(iter([(1.0, 0)])) is None


class _EndsEarly(FakeRunner):
    """Each answer ends (EOS) after `ends_at` positions: the rest of the area costs no step."""

    ends_at = 52

    def _advance(self, slot, st, tau):
        out = super()._advance(slot, st, tau)
        if not out.request_finished and st.committed >= self.ends_at:
            st.committed = st.answer_length
            return dataclasses.replace(out, block_finished=True, request_finished=True,
                                       answer=tuple(t for t in st.tokens if t is not None))
        return out


def test_an_instance_publishes_the_fill_of_the_requests_it_finished(latency):
    engine, _ = make_engine(latency)
    full = [engine.submit(req(f"f{i}", 0.0, 10.0, answer=64, block=16)) for i in range(2)]
    engine.run_until_idle()
    assert all(h.result(0).deadline_met for h in full)
    est = engine.scheduler.snapshot(0.0).estimator
    assert (est.last_block_fill, est.fill_count) == (1.0, 2)  # the decoder here decodes the whole area

    engine, clock = make_engine(latency)
    engine.runner = runner = _EndsEarly(4, clock)
    hs = [engine.submit(req(f"e{i}", 0.0, 10.0, answer=64, block=16)) for i in range(2)]
    engine.run_until_idle()
    assert all(h.result(0).deadline_met for h in hs) and runner.steps_run
    est = engine.scheduler.snapshot(0.0).estimator
    assert est.fill_count == 2 and 0.25 <= est.last_block_fill < 0.5  # 4 of 16 (a step may commit past it)


class _Flat:
    """A refresh 10 ms, a reuse 1 ms, whatever the batch."""

    def round_many(self, kind, batch, canvas, block, tp):
        b = np.asarray(batch, dtype=np.float64) + 0 * np.asarray(canvas)
        return 0.010 + 0 * b if kind == StepKind.REFRESH else 0.001 + 0 * b


def test_a_short_last_block_is_priced_at_the_steps_it_takes():
    sample = [RequestShape(prompt_len=100, answer_len=64, block_len=32, slo_s=1.0)]
    args = (_Flat(), 1, sample, 1, np.array([0.9]), np.array([4.0]))  # 4 tokens a step: 8 steps a full block
    full = service_times(*args)[0, 0, 0]
    assert np.isclose(full, 2 * 0.010 + 14 * 0.001)  # two refreshes, seven reuse steps a block
    quarter = service_times(*args, last_block_fill=0.25)[0, 0, 0]
    assert np.isclose(quarter, 2 * 0.010 + (7 + 1) * 0.001)  # the last block: 8 positions, two steps
    assert np.isclose(service_times(*args, last_block_fill=0.01)[0, 0, 0], 2 * 0.010 + 7 * 0.001)
