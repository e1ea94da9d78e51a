"""`python -m dilaserve_jax.bench.multihost`: how many requests/s the leader of a multi-host server
carries, and what each one costs it.

Starts a local Ray cluster of as many nodes as the most workers asked for (all on this machine),
then for each worker count serves N requests through the leader's cluster (router, request
table, one link per host) over fake-runner hosts whose steps are short, so the leader is what
limits. It measures requests/s and the leader process's CPU time per request and per report
(the workers report a request's commits at every block's end, every step when it streams), and
the same requests over the same fake engines in one process, for reference. From the leader's CPU per request it extrapolates
how many requests/s a 64-host system could send through one leader. It prints what it measured;
nothing here is a pass/fail threshold.
"""
from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from dataclasses import dataclass

from dilaserve_jax.core.cli import add_config_arguments, config_from_args, opt, returns_exit_status, setup_logging, words

log = logging.getLogger(__name__)
MB = 2**20


@dataclass(frozen=True, slots=True)
class MultihostBenchConfig:
    workers: tuple[int, ...] = opt((1, 2, 4), "worker processes (Ray nodes) to measure, comma-separated",
                                   parse=lambda t: tuple(int(w) for w in words(t)))
    requests: int = opt(2000, "requests per measurement")
    concurrency: int = opt(256, "requests in flight at once")
    instances: int = opt(2, "fake instances per host")
    slots: int = opt(16, "slots per instance")
    step_us: float = opt(200.0, "fake reuse step in µs (a refresh takes four times as long)")
    answer: int = opt(32, "answer tokens per request")
    block: int = opt(16, "block length")
    stream: bool = opt(False, "every call follows every step, as a streaming caller does (a report per step)")
    hosts_at_scale: int = opt(64, "host count to extrapolate to")
    json: bool = opt(False, "print the report as one JSON object")

    def __post_init__(self):
        if not self.workers or min(self.workers) < 1 or self.requests < 1 or self.concurrency < 1:
            raise ValueError("need workers, requests and concurrency >= 1")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dilaserve_jax.bench.multihost",
                                description="Requests/s through the leader of a multi-host server over fake-runner "
                                            "worker processes (1, 2, 4 local Ray nodes), the leader's CPU per "
                                            "request, and its extrapolation to 64 hosts.")
    return add_config_arguments(p, MultihostBenchConfig)


def drive(cluster, requests: int, concurrency: int, answer: int, block: int, prefix: str = "r",
          stream: bool = False) -> dict:
    """Send `requests` through `cluster.submit`, `concurrency` at a time; what it took and cost."""
    from dilaserve_jax.serving.cluster.hosts.fake_hosts import letter_answer
    from dilaserve_jax.serving.policy.request import Request, RequestState

    gate = threading.Semaphore(concurrency)
    results, lock, all_done = [], threading.Lock(), threading.Event()

    def finished(fut, prompt):
        gate.release()
        try:
            r = fut.result()
            ok = r.state == RequestState.FINISHED_OK and r.tokens == letter_answer(prompt, answer)
            steps = r.steps
        except Exception:  # noqa: BLE001 - counted as lost
            ok, steps = False, 0
        with lock:
            results.append((ok, steps))
            if len(results) == requests:
                all_done.set()

    t0, cpu0 = time.perf_counter(), time.process_time()
    for i in range(requests):
        gate.acquire()
        now = time.monotonic()
        prompt = tuple(range(3, 11 + i % 7))
        handle = cluster.submit(Request(f"{prefix}{i}", prompt, answer, block, now, now + 600.0),
                                on_progress=(lambda _p: None) if stream else None)
        handle.future.add_done_callback(lambda f, p=prompt: finished(f, p))
    all_done.wait()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    steps = sum(s for _, s in results)
    return {"requests": requests, "lost": sum(1 for ok, _ in results if not ok), "seconds": wall,
            "requests_per_s": requests / wall, "leader_cpu_us_per_request": 1e6 * cpu / requests,
            "steps": steps}


def _one_process(factory, args) -> dict:
    from dilaserve_jax.serving.cluster.cluster import Cluster

    built = factory.build("local")
    cluster = Cluster(built.engines, built.infos, layout="local", policy=built.policy, model_source="fake",
                      tokenizer=None, limits=None, step_timeout_s=None).start()
    cluster.ready = True
    try:
        return drive(cluster, args.requests, args.concurrency, args.answer, args.block, stream=args.stream)
    finally:
        cluster.stop()


def over_hosts(factory, node_ids, args, prefix: str = "r") -> dict:
    """One measurement through a leader over workers on `node_ids` (Ray already connected)."""
    from dilaserve_jax.serving.cluster.hosts.ray_hosts import RayHosts

    hosts = RayHosts(factory, node_ids=node_ids, join_interval_s=3600.0, say=lambda _m: None)
    cluster = hosts.start(step_timeout_s=None).start()
    cluster.ready = True
    try:
        row = drive(cluster, args.requests, args.concurrency, args.answer, args.block, prefix, args.stream)
    finally:
        hosts.stop()
    for key in ("apply", "poll", "ops", "reports", "step_counts"):
        row[f"{key}_calls" if key in ("apply", "poll") else key] = sum(l.calls[key] for l in hosts.links.values())
    row["leader_cpu_us_per_report"] = row["leader_cpu_us_per_request"] * row["requests"] / max(1, row["reports"])
    return row


@returns_exit_status
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = config_from_args(MultihostBenchConfig, parser.parse_args(argv), parser)
    setup_logging(log)
    import ray
    from ray.cluster_utils import Cluster as RayCluster

    from dilaserve_jax.serving.cluster.hosts.fake_hosts import FakeHostFactory

    factory = FakeHostFactory(instances=args.instances, slots=args.slots, step_s=args.step_us * 1e-6,
                              max_queue=max(256, args.concurrency))
    rows = {"one process": _one_process(factory, args)}
    log.info(f"one process: {rows['one process']['requests_per_s']:.0f} requests/s")
    nodes = RayCluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 100 * MB,
                                                             "include_dashboard": False})
    try:
        for _ in range(max(args.workers) - 1):
            nodes.add_node(num_cpus=1, object_store_memory=100 * MB)
        ray.init(address=nodes.address, log_to_driver=False)
        ids = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        for n in args.workers:
            rows[f"{n} worker(s)"] = over_hosts(factory, ids[:n], args, prefix=f"w{n}-")
            log.info(f"{n} worker(s): {rows[f'{n} worker(s)']['requests_per_s']:.0f} requests/s")
    finally:
        ray.shutdown()
        nodes.shutdown()
    report = {"config": {k: getattr(args, k) for k in MultihostBenchConfig.__dataclass_fields__}, "rows": rows,
              "extrapolation": _extrapolate(rows, args)}
    if args.json:
        print(json.dumps(report))
    else:
        _print(report, args)
    return 0


def _extrapolate(rows: dict, args) -> dict:
    """The leader's ceiling from its CPU per request (one core: the leader's Python threads share
    one interpreter lock), and what that leaves each of `hosts_at_scale` hosts."""
    remote = [r for name, r in rows.items() if name != "one process"]
    per_request = max(r["leader_cpu_us_per_request"] for r in remote)
    per_report = max(r["leader_cpu_us_per_report"] for r in remote)
    ceiling = 1e6 / per_request
    return {"leader_cpu_us_per_request": per_request, "leader_cpu_us_per_report": per_report,
            "leader_ceiling_requests_per_s": ceiling, "hosts": args.hosts_at_scale,
            "per_host_requests_per_s_at_ceiling": ceiling / args.hosts_at_scale}


def _print(report: dict, args) -> None:
    print(f"{args.requests} {'streaming ' if args.stream else ''}requests of {args.answer} tokens, "
          f"{args.concurrency} in flight; "
          f"{args.instances} fake instance(s) x {args.slots} slots per host, {args.step_us:g} µs reuse steps")
    print(f"{'':<14}{'req/s':>9}{'lost':>6}{'steps/req':>11}{'reports/req':>13}{'leader µs/req':>15}"
          f"{'µs/report':>11}")
    for name, r in report["rows"].items():
        reports = f"{r['reports'] / r['requests']:.1f}" if "reports" in r else "-"
        per_report = f"{r['leader_cpu_us_per_report']:.1f}" if "reports" in r else "-"
        print(f"{name:<14}{r['requests_per_s']:>9.0f}{r['lost']:>6}{r['steps'] / r['requests']:>11.1f}{reports:>13}"
              f"{r['leader_cpu_us_per_request']:>15.0f}{per_report:>11}")
    x = report["extrapolation"]
    print("(one process: the engines run in that process, so its CPU is theirs too, not a leader's)")
    print(f"leader: {x['leader_cpu_us_per_request']:.0f} µs of CPU per request (the most measured over workers), "
          f"{x['leader_cpu_us_per_report']:.1f} µs per report -> at most "
          f"{x['leader_ceiling_requests_per_s']:.0f} requests/s through one leader; over {x['hosts']} hosts that is "
          f"{x['per_host_requests_per_s_at_ceiling']:.1f} requests/s per host before the leader is the bottleneck")


if __name__ == "__main__":
    raise SystemExit(main())
