"""`python -m dilaserve_jax.bench.policies`: SLO attainment, latency and accuracy of the scheduling
policies on one real instance (Engine + JaxRunner, real clock, in-process, no network).

1. Compiles the steps the workload needs and measures the step-latency profile on them
   (`serving.profiling.measure_profile`); the schedulers use the latency model fitted to it.
2. Capacity: every prompt of the held-out pool alone on the idle instance at τ = 0.9 (its idle
   latency), then the whole pool at once (throughput, requests/s, at τ = 0.9 with all slots).
3. For each rate: one Poisson arrival trace of pool prompts over `--duration` seconds; each request's
   SLO is a multiple, uniform in `--slo-range`, of its own idle latency. Every policy serves the same
   trace, one after another (the order rotates per rate, so background load drifts evenly).
   Answers are graded with the task graders; rejected requests count as SLO misses.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

POLICIES = ("fcfs-static", "edf-static", "dilaserve")


@dataclass(frozen=True, slots=True)
class BenchConfig:
    model: str = "tiny"
    rates: tuple[float, ...] = ()  # requests/s; empty: load_factors x measured capacity
    load_factors: tuple[float, ...] = (0.3, 0.7, 1.2, 2.0)
    duration: float = 10.0
    slo_range: tuple[float, float] = (2.0, 6.0)
    slots: int = 8
    per_task: int = 6  # held-out pool: this many problems per task
    tau_min: float = 0.6
    tau_max: float = 0.9
    static_tau: float = 0.9
    prior: str | None = None  # eval --json rows; default: the model directory's eval.json if present
    profile: str | None = None  # measured profile JSON; default: measured here
    seed: int = 0
    attention: str = "auto"

    def __post_init__(self):
        if self.duration <= 0 or self.slots < 1 or self.per_task < 1:
            raise ValueError("duration, slots and per_task must be positive")
        if not (0 < self.slo_range[0] <= self.slo_range[1]):
            raise ValueError(f"bad SLO range {self.slo_range}")
        if any(r <= 0 for r in self.rates) or any(f <= 0 for f in self.load_factors):
            raise ValueError("rates and load factors must be positive")
        if not (self.rates or self.load_factors):
            raise ValueError("need rates or load factors")
        if not 0 < self.tau_min <= self.tau_max <= 1 or not 0 < self.static_tau <= 1:
            raise ValueError("need 0 < tau_min <= tau_max <= 1 and static_tau in (0, 1]")


@dataclass(frozen=True, slots=True)
class Item:
    problem: object
    tokens: tuple[int, ...]
    answer: int
    block: int


class Bench:
    def __init__(self, cfg: BenchConfig, say, progress: bool):
        from dilaserve_jax.models import load_model
        from dilaserve_jax.tasks.suite import TASKS, task_block, unique_problems

        self.cfg, self.say, self.progress = cfg, say, progress
        self.model = load_model(cfg.model, attention=cfg.attention)
        self.items = [Item(p, tuple(self.model.tokenizer.encode(p.prompt)), t.gen_length, task_block(t.gen_length))
                      for name, t in TASKS.items() for p in unique_problems(name, "heldout", cfg.per_task, cfg.seed)]
        self.lengths: dict[int, int] = {}  # answer length -> canvas length bucket (multiple of 64)
        self.blocks = {it.answer: it.block for it in self.items}  # answer length -> block length
        for it in self.items:
            need = min(-(-(len(it.tokens) + it.answer) // 64) * 64, self.model.config.max_len)
            self.lengths[it.answer] = max(self.lengths.get(it.answer, 0), need)
        self.prior = self._prior()

    def _prior(self) -> dict[float, float] | None:
        from dilaserve_jax.serving.threshold import eval_rows_beside, prior_from_eval_json

        path = self.cfg.prior or eval_rows_beside(self.model.source)
        if path is None:
            self.say("threshold prior: the built-in default (no eval rows found; pass --prior eval.json)")
            return None
        prior = prior_from_eval_json(path)
        self.say(f"threshold prior from {path}: " + ", ".join(f"τ={t:g}: {v:.2f}" for t, v in prior.items()))
        return prior

    def build(self) -> None:
        from dilaserve_jax.serving.latency import LatencyModel, Profile
        from dilaserve_jax.serving.profiling import measure_profile
        from dilaserve_jax.serving.runner import JaxRunner

        m, cfg = self.model, self.cfg
        t0 = time.perf_counter()
        self.runner = JaxRunner(m.config, m.graphdef, m.params, num_slots=cfg.slots,
                                length_buckets=tuple(sorted(set(self.lengths.values()))),
                                block_buckets=tuple(sorted(set(self.blocks.values()))), warm_up=False, progress=False)
        batches = self.runner.decoder.config.batch_buckets
        points, label = [], ""
        for answer, length in sorted(self.lengths.items()):  # also compiles exactly the shapes used
            prof = measure_profile(self.runner, batches=batches, lengths=(length,), blocks=(self.blocks[answer],),
                                   repeats=3, progress=self.progress)
            points.extend(prof.points)
            label, device = prof.label, prof.device
        if cfg.profile:
            self.latency = LatencyModel.from_profile(cfg.profile)
            self.say(f"latency model from {cfg.profile}")
        else:
            self.profile = Profile(label, False, device, m.config.name, tuple(points))
            self.latency = LatencyModel.from_profile(self.profile)
            self.say(f"measured {len(points)} profile points ({label}); fit {self.latency.report}")
        self.say(f"compiled and profiled in {time.perf_counter() - t0:.1f} s")

    # --- one serving run ---
    def serve(self, policy: str, trace: list[tuple[float, int, float]], desc: str = "") -> list:
        """Serve (arrival offset, item index, slo) on a fresh scheduler; returns the finished requests."""
        from tqdm.auto import tqdm

        from dilaserve_jax.serving.engine import Engine
        from dilaserve_jax.serving.request import make_request
        from dilaserve_jax.serving.scheduler import Scheduler, SchedulerConfig
        from dilaserve_jax.serving.threshold import ThresholdConfig

        cfg = self.cfg
        tcfg = ThresholdConfig.with_prior(self.prior) if self.prior else ThresholdConfig()
        sched = Scheduler(SchedulerConfig(cfg.slots, policy=policy, static_tau=cfg.static_tau, max_queue=10_000,
                                          threshold=tcfg), self.latency)
        engine = Engine(self.runner, sched)
        busy = [0.0]  # seconds inside runner steps; the rest of the loop is scheduling and admission
        engine.add_step_hook(lambda name, plan, outs, t0, t1: busy.__setitem__(0, busy[0] + t1 - t0))
        handles, reqs = [], []
        bar = tqdm(total=len(trace), desc=desc, unit="req", file=sys.stderr, leave=False, disable=not self.progress)
        t0 = engine.clock()
        while len(reqs) < len(trace) or not all(h.done() for h in handles):
            now = engine.clock()
            while len(reqs) < len(trace) and now - t0 >= trace[len(reqs)][0]:
                offset, i, slo = trace[len(reqs)]
                it = self.items[i]
                # arrival is the scheduled time: a request that comes in mid-step waits for the step, as it would
                r = make_request(f"q{len(reqs)}", it.tokens, it.answer, it.block, t0 + offset, slo,
                                 tau_min=cfg.tau_min, tau_max=cfg.tau_max)
                reqs.append(r)
                handles.append(engine.submit(r))
            if not engine.step_once():
                time.sleep(0.0005)
            bar.update(sum(h.done() for h in handles) - bar.n)
        while engine.step_once():  # flush the last releases: the runner's slots are free for the next run
            pass
        bar.close()
        self.last_busy, self.last_wall = busy[0], engine.clock() - t0
        return reqs

    def capacity(self) -> tuple[list[float], float]:
        """Idle latency of every pool item at the static τ, and the saturated throughput (req/s)."""
        from tqdm.auto import tqdm

        idle = []
        for i in tqdm(range(len(self.items)), desc="idle latency", unit="req", file=sys.stderr, leave=False,
                      disable=not self.progress):
            runs = [self.serve("fcfs-static", [(0.0, i, 1e9)])[0] for _ in range(2)]
            idle.append(min(r.finish_time - r.arrival for r in runs))  # min: least disturbed by other load
        copies = -(-4 * self.cfg.slots // len(self.items))  # enough work that the slots stay full, not tail-bound
        work = [(0.0, i, 1e9) for _ in range(copies) for i in range(len(self.items))]
        reqs = self.serve("fcfs-static", work, "capacity")
        makespan = max(r.finish_time for r in reqs) - min(r.arrival for r in reqs)
        return idle, len(reqs) / makespan

    def trace(self, rate: float, idle: list[float], seed: int) -> list[tuple[float, int, float]]:
        rng = np.random.default_rng([self.cfg.seed, seed])
        out, t = [], float(rng.exponential(1 / rate))
        while t < self.cfg.duration:
            i = int(rng.integers(len(self.items)))
            out.append((t, i, float(rng.uniform(*self.cfg.slo_range)) * idle[i]))
            t += float(rng.exponential(1 / rate))
        return out

    def metrics(self, policy: str, rate: float, reqs: list) -> dict:
        from dilaserve_jax.serving.request import RequestState
        from dilaserve_jax.tasks.graders import grade

        done = [r for r in reqs if r.state == RequestState.FINISHED_OK]
        lat = np.array([r.finish_time - r.arrival for r in done]) if done else np.array([np.nan])
        index = {it.tokens: it for it in self.items}
        correct = sum(grade(index[r.prompt_tokens].problem, self.model.tokenizer.decode(r.output_tokens or []))
                      for r in done)
        steps = [s for r in done for s in r.steps]
        return {"policy": policy, "rate": rate, "requests": len(reqs), "completed": len(done),
                "rejected": sum(r.state == RequestState.FINISHED_REJECTED for r in reqs),
                "slo_attainment": sum(bool(r.deadline_met) for r in reqs) / max(1, len(reqs)),
                "mean_latency": float(np.mean(lat)), "p99_latency": float(np.percentile(lat, 99)),
                "accuracy": correct / max(1, len(done)),
                "mean_tau": float(np.mean([s.tau for s in steps])) if steps else float("nan"),
                "tokens_per_step": sum(s.n_committed for s in steps) / max(1, len(steps)),
                "step_busy_s": self.last_busy, "wall_s": self.last_wall}


def run(cfg: BenchConfig, say, progress: bool) -> tuple[list[dict], dict]:
    bench = Bench(cfg, say, progress)
    bench.build()
    idle, cap = bench.capacity()
    info = {"capacity_rps": cap, "idle_latency_mean": float(np.mean(idle)), "idle_latency_max": float(np.max(idle)),
            "pool": len(bench.items), "slots": cfg.slots, "slo_range": list(cfg.slo_range), "duration": cfg.duration,
            "tau_range": [cfg.tau_min, cfg.tau_max], "static_tau": cfg.static_tau,
            "latency_model": bench.latency.label, "fit": str(bench.latency.report)}
    say(f"capacity at τ={cfg.static_tau}: {cap:.2f} req/s with {cfg.slots} slots; idle latency mean "
        f"{info['idle_latency_mean'] * 1e3:.0f} ms, max {info['idle_latency_max'] * 1e3:.0f} ms")
    rates = cfg.rates or tuple(round(f * cap, 2) for f in cfg.load_factors)
    rows = []
    for k, rate in enumerate(rates):
        trace = bench.trace(rate, idle, k)
        order = POLICIES[k % 3:] + POLICIES[:k % 3]
        by_policy = {p: bench.metrics(p, rate, bench.serve(p, trace, f"{p} @ {rate:g}/s")) for p in order}
        for p in POLICIES:
            rows.append(by_policy[p] | {"load": rate / cap})
            say(format_row(rows[-1]))
    return rows, info


def format_row(r: dict) -> str:
    return (f"{r['policy']:<12}{r['rate']:>7.2f}{r['load']:>6.2f}{r['requests']:>6}{r['rejected']:>5}"
            f"{100 * r['slo_attainment']:>8.1f}{r['mean_latency']:>9.2f}{r['p99_latency']:>9.2f}"
            f"{100 * r['accuracy']:>7.1f}{r['mean_tau']:>7.2f}{r['tokens_per_step']:>8.2f}")


def format_table(rows: list[dict]) -> str:
    head = (f"{'policy':<12}{'req/s':>7}{'load':>6}{'n':>6}{'rej':>5}{'SLO %':>8}{'mean s':>9}{'p99 s':>9}"
            f"{'acc %':>7}{'τ':>7}{'tok/st':>8}")
    return "\n".join([head, "-" * len(head), *map(format_row, rows)])


def headline(rows: list[dict]) -> str:
    """dilaserve vs fcfs-static at the lowest rate where fcfs-static attains <= 50%."""
    rates = sorted({r["rate"] for r in rows})
    get = {(r["policy"], r["rate"]): r for r in rows}
    rate = next((x for x in rates if get[("fcfs-static", x)]["slo_attainment"] <= 0.5), None)
    if rate is None:
        return "fcfs-static attains > 50% at every rate measured: no overload point to compare at"
    f, d = get[("fcfs-static", rate)], get[("dilaserve", rate)]
    return (f"at {rate:g} req/s (fcfs-static attains {100 * f['slo_attainment']:.1f}%): dilaserve "
            f"{100 * (d['slo_attainment'] - f['slo_attainment']):+.1f} points SLO attainment, mean latency "
            f"{100 * (d['mean_latency'] / f['mean_latency'] - 1):+.0f}%, accuracy "
            f"{100 * (d['accuracy'] - f['accuracy']):+.1f} points")


def plot(rows: list[dict], info: dict, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'dilaserve-jax[plot]' (or pip install matplotlib)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for p in POLICIES:
        rs = sorted((r for r in rows if r["policy"] == p), key=lambda r: r["rate"])
        x = [r["rate"] for r in rs]
        axes[0].plot(x, [100 * r["slo_attainment"] for r in rs], "o-", label=p)
        axes[1].plot(x, [r["mean_latency"] for r in rs], "o-", label=p)
    for ax, title in zip(axes, ("SLO attainment (%)", "mean latency (s)")):
        ax.axvline(info["capacity_rps"], color="grey", ls=":", lw=1)
        ax.set_xlabel("request rate (req/s); dotted: capacity at τ=0.9")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def build_parser() -> argparse.ArgumentParser:
    d = BenchConfig()
    p = argparse.ArgumentParser(
        prog="python -m dilaserve_jax.bench.policies",
        description="Serve Poisson arrivals of held-out task prompts on one real instance with each scheduling "
                    "policy (fcfs-static, edf-static, dilaserve) at several request rates; print SLO attainment, "
                    "mean/p99 latency, accuracy, mean τ and tokens per step.")
    p.add_argument("--model", default=d.model, help="preset or checkpoint directory (default tiny)")
    p.add_argument("--attention", default="auto", choices=("auto", "xla", "pallas"),
                   help="attention implementation (auto = Pallas on GPU/TPU, XLA on CPU)")
    p.add_argument("--rates", type=float, nargs="+", default=None,
                   help="request rates in req/s (default: --load-factors times the measured capacity)")
    p.add_argument("--load-factors", type=float, nargs="+", default=list(d.load_factors),
                   help=f"rates as multiples of the measured capacity (default {' '.join(map(str, d.load_factors))})")
    p.add_argument("--duration", type=float, default=d.duration, help=f"seconds of arrivals per run (default {d.duration:g})")
    p.add_argument("--slo-range", type=float, nargs=2, default=list(d.slo_range), metavar=("LO", "HI"),
                   help="SLO = uniform(LO, HI) x the request's idle latency at τ=0.9 (default 2 6)")
    p.add_argument("--slots", type=int, default=d.slots, help=f"slots of the instance (default {d.slots})")
    p.add_argument("--per-task", type=int, default=d.per_task, help="held-out problems per task in the pool")
    p.add_argument("--tau-min", type=float, default=d.tau_min, help=f"dilaserve quality floor (default {d.tau_min})")
    p.add_argument("--tau-max", type=float, default=d.tau_max, help=f"dilaserve ceiling (default {d.tau_max})")
    p.add_argument("--prior", default=None, help="eval --json rows for the τ -> tokens/step prior")
    p.add_argument("--profile", default=None, help="latency profile JSON (default: measured at start)")
    p.add_argument("--seed", type=int, default=d.seed, help="workload seed (default 0)")
    p.add_argument("--json", action="store_true", help="print the rows (and the capacity info) as JSON")
    p.add_argument("--plot", default=None, help="write attainment and mean latency vs rate to this PNG")
    p.add_argument("--compile-cache", default=os.path.join(os.path.expanduser("~"), ".cache", "dilaserve_jax", "xla"),
                   help="persistent XLA compilation cache directory, or 'none'")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    try:
        cfg = BenchConfig(model=args.model, rates=tuple(args.rates or ()), load_factors=tuple(args.load_factors),
                          duration=args.duration, slo_range=tuple(args.slo_range), slots=args.slots,
                          per_task=args.per_task, tau_min=args.tau_min, tau_max=args.tau_max, prior=args.prior,
                          profile=args.profile, seed=args.seed, attention=args.attention)
        from dilaserve_jax.decoding.compiled import enable_compile_cache

        enable_compile_cache(args.compile_cache)
        rows, info = run(cfg, say, not args.no_progress)
    except (ValueError, FileNotFoundError) as err:
        say(f"error: {err}")
        return 2
    if args.json:
        print(json.dumps({"info": info, "rows": rows}, indent=1))
    else:
        print(format_table(rows))
        print(headline(rows))
    if args.plot:
        plot(rows, info, args.plot)
        say(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
