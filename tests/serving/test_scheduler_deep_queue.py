"""The scheduler's work per iteration at deep queues, counted in the threshold controller's pricing
work (steps left worked out, step-time terms worked out; not seconds, so it holds on a loaded
machine).

Documented bound (docs/simulation.md, "Host time per iteration"): beyond a fixed part (the planned
requests: running ones plus at most `plan_depth` x slots queued), a queued request is priced when
it arrives, again for the lost check only once the slack its last check found has run out, and in
the published load once every queue / `reprice_per_round` rounds. So from 32 queued to 256 the mean
pricing work per iteration grows by at most a constant (`reprice_per_round` per round and change),
not with the 224 extra requests.
"""
import pytest

from dilaserve_jax.bench.host_time import PRICED, HostTimeConfig, measure
from dilaserve_jax.serving.policy.scheduler import SchedulerConfig

BOUND = 2 * SchedulerConfig(1).reprice_per_round


@pytest.mark.parametrize("policy", ["dilaserve", "edf-static"])
def test_work_per_iteration_does_not_grow_with_the_queue(policy):
    cfg = HostTimeConfig(queues=(32, 256), policies=(policy,), iterations=200)
    shallow, deep = (measure(policy, q, cfg) for q in cfg.queues)
    assert deep["iterations"] == cfg.iterations and deep["waiting_min"] >= 240  # the queue stayed deep
    assert deep["waiting_min"] - shallow["waiting_max"] > 5 * BOUND  # a linear cost would show
    for k in PRICED:
        growth = deep[f"{k}_mean"] - shallow[f"{k}_mean"]
        assert growth <= BOUND, (k, shallow[f"{k}_mean"], deep[f"{k}_mean"])
