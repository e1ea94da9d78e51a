"""`python -m dilaserve_jax.bench.hosts_controller`: what one decision of the cluster controller
over many hosts costs the leader.

For each host count, the controller over that many hosts of `--devices` devices (every host on
TP-1 instances, the fake runner's synthetic multi-TP latency model) takes arrivals at `--rate`
for one window and decides once; it prints the candidate layouts it weighed (per-host
partitions combined, or the two-layouts-per-group fallback past `MAX_CANDIDATES`), the time to
enumerate them, the decision's time and the hosts its choice changes. No Ray, no JAX; nothing
here is a pass/fail threshold.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

from dilaserve_jax.core.cli import add_config_arguments, config_from_args, opt, returns_exit_status, words


@dataclass(frozen=True, slots=True)
class HostsControllerBenchConfig:
    hosts: tuple[int, ...] = opt((2, 4, 8, 16, 64), "host counts to measure, comma-separated",
                                 parse=lambda t: tuple(int(h) for h in words(t)))
    devices: int = opt(8, "devices per host")
    rate: float = opt(50.0, "arrivals per second over the window")
    json: bool = opt(False, "print the rows as one JSON object")

    def __post_init__(self):
        if not self.hosts or min(self.hosts) < 1 or self.devices < 1 or not self.rate > 0:
            raise ValueError("need hosts and devices >= 1 and a positive rate")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dilaserve_jax.bench.hosts_controller",
                                description="The cluster controller's decision time over many hosts: candidate "
                                            "layouts per host, the time to list them and to decide once.")
    return add_config_arguments(p, HostsControllerBenchConfig)


def measure(hosts: int, devices: int, rate: float) -> dict:
    from dilaserve_jax.core.host_layouts import changed_hosts, flat_candidates, host_partitions, parse_hosts_layout
    from dilaserve_jax.serving.cluster.fake_runner import fake_tp_profile
    from dilaserve_jax.serving.policy.capacity import RequestShape
    from dilaserve_jax.serving.policy.controller import ControllerConfig
    from dilaserve_jax.serving.policy.hosts_controller import HostsController, HostSlice
    from dilaserve_jax.serving.policy.latency import LatencyModel

    latency = LatencyModel.from_profile(fake_tp_profile((1, 2, 4, 8)))
    tps = tuple(t for t in (1, 2, 4, 8) if t <= devices)
    slices = [HostSlice(f"h{i}", devices, (1,) * devices) for i in range(hosts)]
    t0 = time.perf_counter()
    candidates = flat_candidates([host_partitions(devices, tps)] * hosts)
    enumerate_s = time.perf_counter() - t0
    cfg = ControllerConfig(window_s=10.0, min_dwell_s=0.0, confirmations=1, min_arrivals=1)
    ctl = HostsController(cfg, hosts=lambda: slices, tp_degrees=tps, latency=latency, slots=8, param_bytes=10**9)
    for i in range(int(rate * 11)):
        ctl.observe(RequestShape(32, 64, 16, 2.0), i / rate)
    t0 = time.perf_counter()
    decision = ctl.decide(11.0, (1,) * (hosts * devices))
    decide_s = time.perf_counter() - t0
    changed = changed_hosts(tuple(s.layout for s in slices), parse_hosts_layout(decision.chosen))
    return {"hosts": hosts, "devices": devices, "candidates": len(candidates),
            "enumerate_ms": enumerate_s * 1e3, "decide_ms": decide_s * 1e3, "switch": decision.switch, "hosts_changed": len(changed),
            "chosen": decision.chosen if hosts <= 4 else f"{len(set(decision.chosen.split('|')))} distinct host layouts"}


@returns_exit_status
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = config_from_args(HostsControllerBenchConfig, parser.parse_args(argv), parser)
    rows = [measure(h, args.devices, args.rate) for h in args.hosts]
    if args.json:
        print(json.dumps({"config": {"devices": args.devices, "rate": args.rate}, "rows": rows}))
        return 0
    print(f"hosts of {args.devices} devices, all TP 1, {args.rate:g} arrivals/s over a 10 s window")
    print(f"{'hosts':>6}{'candidates':>12}{'list ms':>9}{'decide ms':>11}{'switch':>8}{'changed':>9}  chosen")
    for r in rows:
        print(f"{r['hosts']:>6}{r['candidates']:>12}{r['enumerate_ms']:>9.1f}{r['decide_ms']:>11.1f}"
              f"{'yes' if r['switch'] else 'no':>8}{r['hosts_changed']:>9}  {r['chosen']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
