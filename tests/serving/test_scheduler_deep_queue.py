"""The scheduler's work per iteration at deep queues, counted in calls of the threshold controller's
per-request cost functions (not seconds, so it holds on a loaded machine).

Documented bound (docs/simulation.md, "Host time per iteration"): beyond a fixed part (the planned
requests: running ones plus at most `plan_depth` x slots queued, each priced at every τ of the
grid), each further queued request costs at most `PER_QUEUED` calls of `remaining_time` and of
`steps_needed` per iteration — it is priced once for the lost check and once in the published
load, never once per τ of the grid.
"""
import pytest

from dilaserve_jax.bench.host_time import HostTimeConfig, measure

PER_QUEUED = 3.0


@pytest.mark.parametrize("policy", ["dilaserve", "edf-static"])
def test_work_per_iteration_grows_at_most_linearly_with_the_queue(policy):
    cfg = HostTimeConfig(queues=(32, 256), policies=(policy,), iterations=200)
    shallow, deep = (measure(policy, q, cfg) for q in cfg.queues)
    assert deep["iterations"] == cfg.iterations and deep["waiting_min"] >= 240  # the queue stayed deep
    extra = deep["waiting_min"] - shallow["waiting_max"]
    for k in ("remaining_time", "steps_needed"):
        growth = deep[f"{k}_max"] - shallow[f"{k}_mean"]
        assert growth <= PER_QUEUED * extra, (k, shallow[f"{k}_mean"], deep[f"{k}_max"])
