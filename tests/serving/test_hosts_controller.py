"""The cluster controller over several hosts (no Ray, no runner): per-host candidates, a switch
that changes only the hosts it must, its cost priced on those hosts, and on one host exactly the
one-host controller's decisions."""
import pytest

from dilaserve_jax.core.host_layouts import parse_hosts_layout
from dilaserve_jax.serving.cluster.fake_runner import fake_tp_profile
from dilaserve_jax.serving.policy.capacity import RequestShape
from dilaserve_jax.serving.policy.controller import ClusterController, ControllerConfig
from dilaserve_jax.serving.policy.hosts_controller import HostsController, HostSlice
from dilaserve_jax.serving.policy.latency import LatencyModel

SHAPE = RequestShape(prompt_len=32, answer_len=64, block_len=16, slo_s=0.4)
CFG = dict(interval_s=1.0, window_s=10.0, min_dwell_s=0.0, confirmations=1, min_arrivals=1, compile_s=10.0, load_s=0.0)


@pytest.fixture(scope="module")
def latency():
    return LatencyModel.from_profile(fake_tp_profile((1, 2, 4, 8)))


class Hosts:
    """The live hosts a test shows the controller (changed by the test)."""

    def __init__(self, text: str, devices: int):
        self.slices = [HostSlice(f"h{i}", devices, part) for i, part in enumerate(parse_hosts_layout(text))]

    def __call__(self):
        return list(self.slices)


def hosts_controller(latency, hosts, **cfg):
    return HostsController(ControllerConfig(**{**CFG, **cfg}), hosts=hosts, tp_degrees=(1, 2, 4, 8), latency=latency,
                           slots=8, param_bytes=10**7)


def arrivals(ctl, rate, seconds=11.0):
    for i in range(int(rate * seconds)):
        ctl.observe(SHAPE, i / rate)
    return seconds


def test_on_one_host_it_decides_as_the_one_host_controller(latency):
    for devices, start in ((8, (1,) * 8), (8, (8,)), (4, (2, 2)), (2, (1, 1))):
        for rate in (0.5, 5.0, 50.0, 400.0):
            one = ClusterController(ControllerConfig(**CFG), num_devices=devices, tp_degrees=(1, 2, 4, 8),
                                    latency=latency, slots=8, param_bytes=10**7)
            hosts = Hosts("+".join(map(str, start)), devices)
            many = hosts_controller(latency, hosts)
            assert many.candidates == one.candidates
            now = arrivals(one, rate)
            arrivals(many, rate)
            a, b = one.decide(now, start), many.decide(now, start)
            assert (b.current, b.chosen, b.switch, b.reason, b.predicted, b.cost) == \
                (a.current, a.chosen, a.switch, a.reason, a.predicted, a.cost), (devices, start, rate)


def test_candidates_are_per_host_and_follow_the_live_hosts(latency):
    hosts = Hosts("2x1|2", 2)
    ctl = hosts_controller(latency, hosts)
    assert sorted(ctl.candidates) == [(1, 1, 1, 1), (2, 1, 1), (2, 2)]  # never a TP 4 over two hosts
    del hosts.slices[1]  # a host lost
    now = arrivals(ctl, 1.0)
    d = ctl.decide(now, (1, 1))
    assert sorted(ctl.candidates) == [(1, 1), (2,)] and d.current == "2x1"


def test_a_switch_changes_only_the_hosts_it_must_and_pays_only_for_them(latency):
    hosts = Hosts("4x1|2", 4)
    hosts.slices[1] = HostSlice("h1", 2, (2,))  # a 4-device host and a 2-device one
    ctl = hosts_controller(latency, hosts)
    now = arrivals(ctl, 1.0)  # light load: the widest instances finish soonest
    d = ctl.decide(now, (2, 1, 1, 1, 1))
    assert d.switch and d.current == "4x1|1x2" and d.chosen == "1x4|1x2"  # the second host stays
    assert set(d.predicted) >= {"4x1|1x2", "1x4|1x2"}
    # only the first host compiles (one TP-4 placement it did not run); changing both hosts waits for
    # the slower, the second (two TP-1 placements, and its devices receive the halves they lacked)
    assert ctl.switch_seconds((2, 1, 1, 1, 1), (4, 2), [SHAPE])[0] == pytest.approx(10.0)
    assert ctl.switch_seconds((2, 1, 1, 1, 1), (4, 1, 1), [SHAPE])[0] == pytest.approx(20.0 + 1e7 / 100e9)
    hosts.slices[0] = HostSlice("h0", 4, (4,))  # the switch applied
    ctl.switched(now)
    d = ctl.decide(now + 1, (4, 2))
    assert not d.switch and d.current == "1x4|1x2"


def test_under_heavy_load_it_narrows_the_wide_host_and_keeps_the_narrow_one(latency):
    hosts = Hosts("2|2x1", 2)
    ctl = hosts_controller(latency, hosts)
    now = arrivals(ctl, 400.0)
    d = ctl.decide(now, (2, 1, 1))
    assert d.switch and d.chosen == "2x1|2x1"
    assert ctl.hosts_layout((1, 1, 1, 1)) == ((1, 1), (1, 1))


def test_a_host_without_instances_yet_holds_the_decision(latency):
    hosts = Hosts("2x1|2", 2)
    ctl = hosts_controller(latency, hosts)
    hosts.slices[1] = HostSlice("h1", 2, ())
    d = ctl.decide(arrivals(ctl, 1.0), (1, 1))
    assert not d.switch and "joining" in d.reason


def test_a_decision_over_64_hosts_of_8_devices_stays_well_under_its_interval():
    from dilaserve_jax.bench.hosts_controller import measure

    row = measure(64, 8, 50.0)
    assert row["candidates"] > 64 and row["switch"]
    assert row["enumerate_ms"] + row["decide_ms"] < 1000  # the controller decides every 2 s by default
