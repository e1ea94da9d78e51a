
import pytest

from dilaserve_jax.serving.policy.request import IllegalTransition, Request, RequestState
from dilaserve_jax.core.kinds import StepKind


def _req():
    return Request("a", (1, 2, 3), 32, 16, arrival=0.0, deadline=1.0)


def test_legal_lifecycle_records_times_and_progress():
    r = _req()
    assert (r.masked_left, r.blocks_left, r.masked_in_block, r.next_kind) == (32, 2, 16, StepKind.REFRESH)
    r.transition(RequestState.RUNNING, 0.1)
    r.record_step(StepKind.REFRESH, 0.9, 5, False, 0.2, 0.1)
    assert (r.masked_left, r.blocks_left, r.masked_in_block, r.next_kind) == (27, 2, 11, StepKind.REUSE)
    r.record_step(StepKind.REUSE, 0.8, 11, True, 0.3, 0.1)
    assert (r.blocks_left, r.next_kind) == (1, StepKind.REFRESH)
    r.transition(RequestState.FINISHED_OK, 0.5)
    assert r.start_time == 0.1 and r.finish_time == 0.5 and r.deadline_met is True
    assert [(s.kind, s.tau, s.n_committed) for s in r.steps] == [(StepKind.REFRESH, 0.9, 5), (StepKind.REUSE, 0.8, 11)]


@pytest.mark.parametrize("path", [
    (RequestState.FINISHED_OK,),  # cannot finish without running
    (RequestState.RUNNING, RequestState.MIGRATING, RequestState.WAITING),  # moving, it is re-admitted, not queued
    (RequestState.RUNNING, RequestState.FINISHED_OK, RequestState.RUNNING),
    (RequestState.FINISHED_ABORTED, RequestState.FINISHED_OK),
    (RequestState.RUNNING, RequestState.FINISHED_REJECTED),
])
def test_illegal_transitions_raise(path):
    r = _req()
    for s in path[:-1]:
        r.transition(s, 0.0)
    with pytest.raises(IllegalTransition):
        r.transition(path[-1], 0.0)


def test_a_preempted_request_waits_again_with_its_canvas():
    r = _req()
    r.transition(RequestState.RUNNING, 0.0)
    r.slot = 3
    r.record_step(StepKind.REFRESH, 0.9, 5, False, 0.2, 0.1, positions=(0, 1), tokens=(7, 8))
    r.preempt(0.3)
    assert (r.state, r.slot, r.needs_refresh, r.preemptions) == (RequestState.WAITING, None, True, 1)
    assert r.committed_answer[:2] == (7, 8) and r.start_time == 0.0


def test_late_finish_is_a_miss_and_step_when_not_running_raises():
    r = _req()
    with pytest.raises(IllegalTransition):
        r.record_step(StepKind.REFRESH, 0.9, 1, False, 0.0, 0.0)
    r.transition(RequestState.RUNNING, 0.0)
    r.transition(RequestState.FINISHED_OK, 2.0)
    assert r.deadline_met is False


@pytest.mark.parametrize("kw", [dict(answer_length=30), dict(tau_min=0.9, tau_max=0.5), dict(deadline=-1.0)])
def test_bad_request_rejected(kw):
    args = dict(id="a", prompt_tokens=(1,), answer_length=32, block_length=16, arrival=0.0, deadline=1.0)
    args.update(kw)
    with pytest.raises(ValueError):
        Request(**args)


def test_the_plan_carries_each_requests_block_and_the_fake_runner_checks_it():
    from dilaserve_jax.serving.cluster.fake_runner import FakeRunner
    from dilaserve_jax.serving.policy.request import make_request
    from dilaserve_jax.serving.policy.scheduler import Scheduler, SchedulerConfig
    from dilaserve_jax.serving.policy.latency import LatencyModel
    from dilaserve_jax.serving.cluster.fake_runner import fake_profile

    runner = FakeRunner(2)
    sch = Scheduler(SchedulerConfig(num_slots=2, policy="edf-static"), LatencyModel.from_profile(fake_profile()))
    sch.add(make_request("a", (1, 2, 3), 16, 8, 0.0, 100.0), 0.0)
    seen = []
    for _ in range(100):
        plan = sch.schedule(runner.clock())
        if plan is None:
            break
        for slot in plan.releases:
            runner.release(slot)
        for a in plan.admits:
            runner.admit(a.slot, a.prompt_tokens, a.answer_length, a.block_length)
        if plan.has_step:
            assert plan.blocks == tuple(sch.running[s].block_index for s in plan.slots)
            seen.extend(plan.blocks)
            sch.update(plan, runner.step(plan.kind, plan.slots, plan.taus, plan.blocks), runner.clock())
    assert set(seen) == {0, 1}  # both blocks of the answer were stepped, each named by the plan
    runner.admit(1, (1, 2, 3), 16, 8)
    with pytest.raises(ValueError, match="plan says block 1"):
        runner.step(StepKind.REFRESH, [1], [0.9], [1])
