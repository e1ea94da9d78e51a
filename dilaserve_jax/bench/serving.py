"""`python -m dilaserve_jax.bench.serving --target HOST:PORT`: an open-loop gRPC load generator.

The workloads and the report are the simulator's (`sim.workload`, `sim.report`), so a simulated run
and a live one can be compared line by line:

- Arrivals: a trace CSV or poisson/bursty/diurnal, `--rate-scale`, `--duration` (see
  `python -m dilaserve_jax.sim --help`). Calls are sent at their arrival times whatever happened to
  the earlier ones (open loop), at most `--max-concurrency` in flight: an arrival that finds the cap
  reached waits, and that wait counts in its latency (it is recorded apart too).
- Prompts: `--model tiny` (the embedded model) sends held-out problems of its task suite as text (a
  trace row asking for at most 12 tokens becomes a short-answer task, a longer one a phrase task)
  and grades the answers; any other model gets raw token ids of the trace's context length, the
  answer area rounded up to 32-token blocks from its generated tokens (no grader: accuracy n/a).
- SLOs: `fixed:SECONDS`, or `idle:LO,HI` = uniform(LO, HI) × the request's idle latency, measured
  first by sending each distinct prompt shape alone at τ = `--static-tau`.
- The report: SLO attainment (a call meets its SLO when it returns OK within it, measured at the
  client), latency percentiles, graded accuracy, mean τ, and the count of every gRPC status code;
  `--records FILE` writes one JSON line per request.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
from dataclasses import dataclass, replace

import numpy as np

from dilaserve_jax.core.cli import add_config_arguments, config_from_args, opt, returns_exit_status, setup_logging
from dilaserve_jax.sim.report import format_table, summarize
from dilaserve_jax.sim.workload import (RequestSpec, TinyShapes, arrival_times, build_shapes, is_synthetic,
                                        llada_shape, load_trace, parse_slo)

log = logging.getLogger(__name__)
TOKEN_RANGE = (100, 1000)  # raw prompts: token ids drawn here (clear of the usual special ids)


@dataclass
class Outcome:
    spec: RequestSpec
    index: int
    sent: float = 0.0
    done: float | None = None
    status: str = "PENDING"
    response: object = None


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """Where the load goes and how it is sent (the arrivals: sim's WorkloadConfig)."""

    target: str = opt("127.0.0.1:50051", "server address HOST:PORT")
    model: str = opt("tiny", "tiny: task prompts of the embedded model, graded; anything else: raw token ids")
    max_len: int = opt(4096, "raw prompts: prompt + answer limit")
    max_answer: int = opt(512, "raw prompts: largest answer area")
    tau_min: float | None = opt(None, "per-request τ floor", default_text="the server's")
    tau_max: float | None = opt(None, "per-request τ ceiling", default_text="the server's")
    static_tau: float = opt(0.9, "τ of the idle-latency measurement")
    max_concurrency: int = opt(256, "calls in flight at most")
    drain_s: float = opt(120.0, "seconds to wait for calls after the last arrival; the rest are cancelled")
    wait_ready_s: float = opt(600.0, "wait up to this long for the server's health check to say SERVING before "
                                     "sending (a server warms up before it serves; 0 = do not wait)")
    auth_token: str | None = opt(None, "bearer token (or DILASERVE_AUTH_TOKEN)", env="DILASERVE_AUTH_TOKEN")
    records: str | None = opt(None, "write one JSON line per request to FILE", metavar="FILE")
    json: bool = opt(False, "print the report as JSON")
    progress: bool = opt(True, "progress bar on stderr")

    def __post_init__(self):
        if self.max_concurrency < 1 or self.drain_s < 0:
            raise ValueError("--max-concurrency must be >= 1 and --drain-s >= 0")


def build_parser() -> argparse.ArgumentParser:
    from dilaserve_jax.sim.__main__ import add_workload_args

    p = argparse.ArgumentParser(
        prog="python -m dilaserve_jax.bench.serving",
        description="Open-loop gRPC load generator: send a trace or synthetic arrivals to a DiLaServe server and "
                    "print SLO attainment, latency percentiles, graded accuracy and status codes (the simulator's "
                    "report).")
    add_config_arguments(p, LoadConfig, only=("target",))
    add_workload_args(p)
    return add_config_arguments(p, LoadConfig, exclude=("target",))


def make_workload(args, rng: np.random.Generator) -> list[RequestSpec]:
    synthetic = is_synthetic(args.trace)
    trace = None if synthetic else load_trace(args.trace)
    lengths = load_trace(args.lengths) if synthetic and args.lengths else None
    times = arrival_times(args.trace, duration=args.duration, rate_scale=args.rate_scale, rng=rng, trace=trace)
    source = trace if trace is not None else lengths
    if args.model == "tiny":
        shapes = build_shapes("tiny", len(times), rng, trace=source, from_trace_rows=not synthetic,
                              tiny=TinyShapes(seed=args.seed))
        return [RequestSpec(float(t), s.task, s.prompt_tokens, s.answer_length, s.block_length, None, problem=s.problem)
                for t, s in zip(times, shapes)]
    out = []
    for k, t in enumerate(times):
        if source is not None:
            row = k if not synthetic else int(rng.integers(len(source)))
            s = llada_shape(int(source.context[row]), int(source.generated[row]), max_len=args.max_len,
                            max_answer=args.max_answer, task="raw")
        else:
            s = llada_shape(512, 255, max_len=args.max_len, max_answer=args.max_answer, task="raw")
        tokens = tuple(int(x) for x in rng.integers(*TOKEN_RANGE, size=s.prompt_len))
        out.append(RequestSpec(float(t), "raw", tokens, s.answer_length, s.block_length, s.finish_tokens))
    return out


def _request(client, spec: RequestSpec, args, request_id: str, slo: float | None, tau: float | None = None):
    prompt = spec.problem.prompt if spec.problem is not None else list(spec.prompt_tokens)
    t_min = tau if tau is not None else args.tau_min
    t_max = tau if tau is not None else args.tau_max
    return client.request(prompt, max_new_tokens=spec.answer_length, block_length=spec.block_length,
                          slo_ms=None if slo is None else 1e3 * slo, tau_min=t_min, tau_max=t_max,
                          request_id=request_id)


def measure_idle(client, specs: list[RequestSpec], args, say) -> dict:
    """Idle latency of each distinct prompt shape: one call alone at the static τ."""
    key = (lambda s: s.prompt_tokens) if args.model == "tiny" else (lambda s: (len(s.prompt_tokens) // 64, s.answer_length))
    distinct = {}
    for s in specs:
        distinct.setdefault(key(s), s)
    if len(distinct) > 400:
        raise ValueError(f"{len(distinct)} distinct prompt shapes to measure idle latencies for; use --slo fixed:S")
    say(f"measuring the idle latency of {len(distinct)} prompt shapes (one call each, alone)")
    idle = {}
    for k, (shape, s) in enumerate(distinct.items()):
        t0 = time.perf_counter()
        client.stub.Generate(_request(client, s, args, f"idle-{k}", 3600.0, args.static_tau), timeout=600)
        idle[shape] = time.perf_counter() - t0
    return {"key": key, "idle": idle}


def run(args, say) -> tuple[dict, list[dict]]:
    import grpc

    from dilaserve_jax.frontend.client import DiLaServeClient

    if args.max_concurrency < 1 or args.drain_s < 0:
        raise ValueError("--max-concurrency must be >= 1 and --drain-s >= 0")
    rng = np.random.default_rng([args.seed, 1])
    specs = make_workload(args, rng)
    if not specs:
        raise ValueError("the workload has no requests (check --duration and the rate)")
    import os

    client = DiLaServeClient(args.target, auth_token=args.auth_token or os.environ.get("DILASERVE_AUTH_TOKEN"),
                             retries=False)
    if args.wait_ready_s > 0:
        say(f"waiting for {args.target} to serve (health check, up to {args.wait_ready_s:g} s)")
        say(f"{args.target} serving after {client.wait_ready(args.wait_ready_s):.1f} s")
    kind, vals = parse_slo(args.slo)
    if kind == "fixed":
        specs = [replace(s, slo=vals[0]) for s in specs]
    else:
        m = measure_idle(client, specs, args, say)
        slo_rng = np.random.default_rng([args.seed, 17])
        specs = [replace(s, slo=float(slo_rng.uniform(*vals)) * m["idle"][m["key"](s)]) for s in specs]
    outcomes = [Outcome(s, i) for i, s in enumerate(specs)]
    slots = threading.BoundedSemaphore(args.max_concurrency)
    lock = threading.Lock()
    finished = [0]
    bar = None
    if args.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(specs), desc="calls", unit="req", file=sys.stderr, leave=False)
    t0 = time.perf_counter()

    def on_done(fut, o: Outcome) -> None:
        o.done = time.perf_counter() - t0
        try:
            o.response = fut.result()
            o.status = "OK"
        except grpc.FutureCancelledError:
            o.status = "CANCELLED"
        except grpc.RpcError as err:
            o.status = err.code().name
        slots.release()
        with lock:
            finished[0] += 1

    futures = []
    for o in outcomes:
        wait = o.spec.arrival - (time.perf_counter() - t0)
        if wait > 0:
            time.sleep(wait)
        slots.acquire()
        o.sent = time.perf_counter() - t0
        fut = client.stub.Generate.future(_request(client, o.spec, args, f"b{o.index}", o.spec.slo),
                                          metadata=client._metadata)
        fut.add_done_callback(lambda f, o=o: on_done(f, o))
        futures.append(fut)
        if bar is not None:
            bar.update(finished[0] - bar.n)
    end = time.perf_counter() + args.drain_s
    while time.perf_counter() < end and finished[0] < len(outcomes):
        time.sleep(0.05)
        if bar is not None:
            bar.update(finished[0] - bar.n)
    for f in futures:
        if not f.done():
            f.cancel()
    time.sleep(0.1)
    if bar is not None:
        bar.close()
    records = [_record(o, args) for o in outcomes]
    duration = args.duration or (specs[-1].arrival if specs else 0.0)
    row = {"system": args.target, "rate": len(specs) / duration if duration else 0.0,
           **summarize(records, duration=duration)}
    codes: dict[str, int] = {}
    for r in records:
        codes[r["status"]] = codes.get(r["status"], 0) + 1
    row["status_codes"] = codes
    row["client_wait_mean"] = float(np.mean([r["client_wait"] for r in records]))
    return row, records


def _record(o: Outcome, args) -> dict:
    from dilaserve_jax.tasks.graders import grade

    resp = o.response
    ok = o.status == "OK"
    latency = None if o.done is None else o.done - o.spec.arrival
    valid = None
    if ok and o.spec.problem is not None:
        valid = bool(grade(o.spec.problem, resp.text))
    state = {"OK": "FINISHED_OK", "RESOURCE_EXHAUSTED": "FINISHED_REJECTED"}.get(o.status, o.status)
    steps = int(resp.steps) if ok else 0
    return {"id": f"b{o.index}", "task": o.spec.task, "arrival": o.spec.arrival, "sent": o.sent,
            "client_wait": o.sent - o.spec.arrival, "finish": o.done if ok else None, "latency": latency,
            "slo": o.spec.slo, "status": o.status, "state": state,
            "met": bool(ok and latency is not None and latency <= o.spec.slo),
            "server_deadline_met": bool(resp.deadline_met) if ok else False,
            "steps": steps, "tau_sum": float(resp.mean_tau) * steps if ok else 0.0,
            "committed": len(resp.token_ids) if ok else 0, "taus": list(resp.taus) if ok else [],
            "valid": valid, "moves": int(resp.moves) if ok else 0, "instance": resp.instance if ok else "",
            "prompt_len": len(o.spec.prompt_tokens), "answer_length": o.spec.answer_length}


@returns_exit_status
def main(argv: list[str] | None = None) -> int:
    from dilaserve_jax.sim.__main__ import WorkloadConfig

    parser = build_parser()
    args = parser.parse_args(argv)
    for cls in (WorkloadConfig, LoadConfig):  # validation; the run reads the parsed flags themselves
        config_from_args(cls, args, parser)
    setup_logging(log)
    try:
        row, records = run(args, log.info)
    except (ValueError, FileNotFoundError, TimeoutError) as err:
        log.error(f"error: {err}")
        return 2
    if args.records:
        with open(args.records, "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    if args.json:
        print(json.dumps(row, indent=1))
    else:
        print(format_table([row]))
        print("status codes: " + ", ".join(f"{k} {v}" for k, v in sorted(row["status_codes"].items())))
        print(f"latency p50 {row['p50_latency']:.3f} s, p90 {row['p90_latency']:.3f} s, p99 {row['p99_latency']:.3f} s; "
              f"graded {row['graded']} answers; client wait (concurrency cap) mean {1e3 * row['client_wait_mean']:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
