"""`python -m dilaserve_jax.bench.policies`: SLO attainment, latency and accuracy of the scheduling
policies on one real instance (Engine + JaxRunner, real clock, in-process, no network).

1. Compiles the steps the workload needs and measures the step-latency profile on them
   (`serving.executor.profiling.measure_profile`); the schedulers use the latency model fitted to it.
2. Capacity: every prompt of the held-out pool alone on the idle instance at the static τ (its idle
   latency, and whether its answer is valid there: the per-prompt reference the accuracy drop is
   paired against), then the whole pool at once (throughput, requests/s, with all slots).
3. For each rate: one Poisson arrival trace of pool prompts over `--duration` seconds; each request's
   SLO is a multiple, uniform in `--slo-range`, of its own idle latency. Every run serves the same
   trace, one after another (the order rotates per rate, so background load drifts evenly):
   fcfs-static, edf-static, and dilaserve once per accuracy-loss budget of the sweep (plus the
   fixed-floor baseline at the finite positive budgets). Answers are graded with the task graders;
   rejected requests count as SLO misses.

The pool skips the held-out problems the shipped eval rows were measured on (`--pool-skip`), so the
accuracy model is never tested on the problems it was calibrated with.

Clocks: `--clock real` (default) serves in real time, so other jobs on the machine slow the steps
and the scheduling alike. `--clock modeled` runs the same real steps (the same tokens, the same
graded answers) but advances a virtual clock by each step's measured time from the start-up
profile (its (kind, batch, canvas, block) shape), so a run is reproducible and other load cannot
touch it; host-side scheduling time is then not counted.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

from dilaserve_jax.core.buckets import bucket_for, slot_buckets
from dilaserve_jax.bench.policies_report import format_table, headline, plot_pareto, plot_rates, run_row

DEFAULT_BUDGETS = (0.0, 0.5, 1.0, 2.0, 5.0, None)  # points; None: unbounded
CLOCKS = ("real", "modeled")


@dataclass(frozen=True, slots=True)
class BenchConfig:
    model: str = "tiny"
    rates: tuple[float, ...] = ()  # requests/s; empty: load_factors x measured capacity
    load_factors: tuple[float, ...] = (0.3, 0.7, 1.2, 2.0)
    duration: float = 10.0
    slo_range: tuple[float, float] = (2.0, 6.0)
    slots: int = 8
    per_task: int = 20  # held-out pool: this many problems per task
    pool_skip: int = 100  # skip the first held-out problems per task (the eval rows' sample)
    tau_min: float = 0.6
    tau_max: float = 0.9
    static_tau: float = 0.9
    budgets: tuple[float | None, ...] = DEFAULT_BUDGETS
    floor_baseline: bool = True  # also run the fixed floor at the finite positive budgets
    prior: str | None = None  # eval --json rows; default: the model directory's eval.json if present
    profile: str | None = None  # profile JSON for the latency model (and the modeled clock); default: measured here
    save_profile: str | None = None  # write the profile measured at start-up here
    profile_passes: int = 3  # the profile keeps each shape's fastest pass (other jobs only slow steps down)
    traces: int = 1  # Poisson traces per rate (different seeds); every run serves all of them, pooled
    seed: int = 0
    attention: str = "auto"
    clock: str = "real"  # "real" or "modeled" (virtual clock advanced by each step's profiled time)

    def __post_init__(self):
        if self.clock not in CLOCKS:
            raise ValueError(f"clock must be one of {CLOCKS}, got {self.clock!r}")
        if (self.duration <= 0 or self.slots < 1 or self.per_task < 1 or self.pool_skip < 0 or self.profile_passes < 1
                or self.traces < 1):
            raise ValueError("duration, slots and per_task must be positive, pool_skip >= 0")
        if not (0 < self.slo_range[0] <= self.slo_range[1]):
            raise ValueError(f"bad SLO range {self.slo_range}")
        if any(r <= 0 for r in self.rates) or any(f <= 0 for f in self.load_factors):
            raise ValueError("rates and load factors must be positive")
        if not (self.rates or self.load_factors):
            raise ValueError("need rates or load factors")
        if not 0 < self.tau_min <= self.tau_max <= 1 or not 0 < self.static_tau <= 1:
            raise ValueError("need 0 < tau_min <= tau_max <= 1 and static_tau in (0, 1]")
        if not self.budgets or any(b is not None and not (0 <= b < math.inf) for b in self.budgets):
            raise ValueError(f"budgets must be points >= 0 (or unbounded), got {self.budgets}")

    def runs(self, floor_of=None) -> list[tuple[str, float | None, str]]:
        """(policy, budget, mode) of every run at one rate. The fixed floor runs only at the budgets
        whose floor lies below the budget-0 floor (`floor_of(budget) -> τ`); elsewhere it is the
        budget-0 policy."""
        out = [("fcfs-static", None, "-"), ("edf-static", None, "-")]
        out += [("dilaserve", b, "adaptive") for b in self.budgets]
        if self.floor_baseline:
            out += [("dilaserve", b, "floor") for b in self.budgets if b is not None and b > 0
                    and (floor_of is None or floor_of(b) < floor_of(0.0))]
        return out


@dataclass(frozen=True, slots=True)
class RunTiming:
    """Where one serving run's time went."""

    steps: list  # every step: (kind, [(canvas, block) of each of its requests], start, end)
    iterations_s: float  # inside engine iterations that did work: the steps and the host's part around them
    wall_s: float  # the whole run

    @property
    def step_s(self) -> float:
        return sum(t1 - t0 for _, _, t0, t1 in self.steps)

    @property
    def host_s_per_step(self) -> float:
        """Host time per step outside the compiled calls (scheduling, admission, copies)."""
        return (self.iterations_s - self.step_s) / max(1, len(self.steps))


@dataclass(frozen=True, slots=True)
class Item:
    problem: object
    tokens: tuple[int, ...]
    answer: int
    block: int


class ProfiledTimeRunner:
    """The real runner, with a virtual clock advanced by each step's measured time: the profile's
    median for the step's (kind, batch bucket, canvas bucket, block bucket), else the latency model's
    prediction. Tokens and answers are the real runner's."""

    def __init__(self, runner, clock, step_seconds: dict, latency) -> None:
        self.runner, self.clock, self.step_seconds, self.latency = runner, clock, step_seconds, latency
        self.num_slots, self.tp_degree = runner.num_slots, runner.tp_degree
        cfg = runner.decoder.config
        self._lengths, self._blocks, self._batches = cfg.length_buckets, cfg.block_buckets, cfg.batch_buckets
        self._shape: dict[int, tuple[int, int]] = {}  # slot -> (canvas bucket, block bucket)

    def admit(self, slot, prompt_tokens, answer_length, block_length, **kw) -> None:
        self.runner.admit(slot, prompt_tokens, answer_length, block_length, **kw)
        self._shape[slot] = slot_buckets(len(prompt_tokens), answer_length, block_length, self._lengths, self._blocks)

    def release(self, slot) -> None:
        self.runner.release(slot)
        self._shape.pop(slot, None)

    def step(self, kind, slots, taus, blocks=None):
        out = self.runner.step(kind, slots, taus, blocks)
        batch = bucket_for(len(slots), self._batches)
        canvas = max(self._shape[s][0] for s in slots)
        block = max(self._shape[s][1] for s in slots)
        seconds = self.step_seconds.get((kind, batch, canvas, block))
        if seconds is None:
            seconds = self.latency.predict(kind, batch, canvas, block, self.tp_degree)
        self.clock.advance(seconds)
        return out


def budget_label(budget: float | None) -> str:
    return "inf" if budget is None else f"{budget:g}"


class Bench:
    def __init__(self, cfg: BenchConfig, say, progress: bool):
        from dilaserve_jax.models import load_model
        from dilaserve_jax.tasks.suite import TASKS, task_block, unique_problems

        self.cfg, self.say, self.progress = cfg, say, progress
        self.model = load_model(cfg.model, attention=cfg.attention)
        self.items = []
        for name, t in TASKS.items():
            problems = unique_problems(name, "heldout", cfg.pool_skip + cfg.per_task, cfg.seed)[cfg.pool_skip:]
            self.items += [Item(p, tuple(self.model.tokenizer.encode(p.prompt)), t.gen_length, task_block(t.gen_length))
                           for p in problems]
        self.index = {it.tokens: i for i, it in enumerate(self.items)}
        self.lengths: dict[int, int] = {}  # answer length -> canvas length bucket (multiple of 64)
        self.blocks = {it.answer: it.block for it in self.items}  # answer length -> block length
        for it in self.items:
            need = min(-(-(len(it.tokens) + it.answer) // 64) * 64, self.model.config.max_len)
            self.lengths[it.answer] = max(self.lengths.get(it.answer, 0), need)
        self.rows = self._eval_rows()
        self.reference: list[bool] = []  # per item: valid at the static τ alone

    def _eval_rows(self) -> list[dict] | None:
        from dilaserve_jax.serving.policy.eval_rows import describe_priors, eval_rows_beside, read_eval_rows

        path = self.cfg.prior or eval_rows_beside(self.model.source)
        if path is None:
            self.say("no eval rows (pass --prior eval.json): built-in speed prior, no accuracy model, "
                     "accuracy budgets not enforced")
            return None
        rows = read_eval_rows(path)
        self.say(f"threshold priors from {path}: {describe_priors(rows)}")
        return rows

    def threshold_config(self, budget: float | None, mode: str):
        from dilaserve_jax.serving.policy.threshold import ThresholdConfig

        if self.rows is None:
            return ThresholdConfig()
        return ThresholdConfig.from_eval(self.rows, max_accuracy_drop=budget, budget_mode=mode if mode != "-" else "adaptive")

    def floor_of(self):
        """budget -> the fixed floor at this benchmark's τ range (None without an accuracy model)."""
        if self.rows is None:
            return None
        from dilaserve_jax.serving.policy.quality import AccuracyModel
        from dilaserve_jax.serving.policy.threshold import TAU_GRID

        model, cfg = AccuracyModel.from_eval(self.rows), self.cfg
        grid = sorted({t for t in TAU_GRID if cfg.tau_min <= t <= cfg.tau_max} | {cfg.tau_min, cfg.tau_max})
        return lambda budget: model.floor(budget, cfg.tau_max, grid)

    def build(self) -> None:
        from dilaserve_jax.serving.policy.latency import LatencyModel, Profile
        from dilaserve_jax.serving.executor.profiling import measure_profile
        from dilaserve_jax.serving.executor.runner import JaxRunner

        m, cfg = self.model, self.cfg
        t0 = time.perf_counter()
        self.runner = JaxRunner(m.config, m.graphdef, m.params, num_slots=cfg.slots,
                                length_buckets=tuple(sorted(set(self.lengths.values()))),
                                block_buckets=tuple(sorted(set(self.blocks.values()))), warm_up=False, progress=False)
        batches = self.runner.decoder.config.batch_buckets
        best: dict[tuple, object] = {}  # per shape, the fastest pass: the least disturbed by other jobs
        label = device = ""
        for _ in range(cfg.profile_passes):
            for answer, length in sorted(self.lengths.items()):  # also compiles exactly the shapes used
                prof = measure_profile(self.runner, batches=batches, lengths=(length,),
                                       blocks=(self.blocks[answer],), repeats=3, progress=self.progress)
                for p in prof.points:
                    key = (p.kind, p.batch, p.canvas, p.block, p.tp)
                    if key not in best or p.seconds < best[key].seconds:
                        best[key] = p
                label, device = f"{prof.label}, fastest of {cfg.profile_passes} passes", prof.device
        points = list(best.values())
        measured = Profile(label, False, device, m.config.name, tuple(points))
        if cfg.save_profile:
            measured.save(cfg.save_profile)
            self.say(f"wrote the measured profile to {cfg.save_profile}")
        self.profile = Profile.load(cfg.profile) if cfg.profile else measured
        self.latency = LatencyModel.from_profile(self.profile)
        self.step_seconds = {(p.kind, p.batch, p.canvas, p.block): p.seconds for p in self.profile.points}
        source = cfg.profile or f"{len(points)} points measured now ({label})"
        self.say(f"latency model{' and modeled step times' if cfg.clock == 'modeled' else ''} from {source}; "
                 f"fit {self.latency.report}")
        self.say(f"compiled and profiled in {time.perf_counter() - t0:.1f} s")

    # --- one serving run ---
    def serve(self, policy: str, trace: list[tuple[float, int, float]], desc: str = "", budget: float | None = None,
              mode: str = "-") -> list:
        """Serve (arrival offset, item index, slo) on a fresh scheduler; returns the finished requests.
        Where the time went is left in `last_timing`, the instance's own quality accounting in
        `last_quality`."""
        from tqdm.auto import tqdm

        from dilaserve_jax.serving.cluster.engine import Engine
        from dilaserve_jax.serving.policy.request import make_request
        from dilaserve_jax.serving.policy.scheduler import Scheduler, SchedulerConfig

        cfg = self.cfg
        sched = Scheduler(SchedulerConfig(cfg.slots, policy=policy, static_tau=cfg.static_tau, max_queue=10_000,
                                          threshold=self.threshold_config(budget, mode)), self.latency)
        if cfg.clock == "modeled":
            from dilaserve_jax.serving.cluster.fake_runner import FakeClock

            clock = FakeClock()
            engine = Engine(ProfiledTimeRunner(self.runner, clock, self.step_seconds, self.latency), sched, clock=clock)
        else:
            clock = None
            engine = Engine(self.runner, sched)
        shapes: dict[str, tuple[int, int]] = {}  # request id -> (canvas, block)
        steps: list[tuple[int, list, float, float]] = []
        engine.add_step_hook(lambda name, plan, outs, t0, t1: steps.append(
            (int(plan.kind), [shapes[r] for r in plan.request_ids], t0, t1)))
        iterations = 0.0
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
                shapes[r.id] = (len(it.tokens) + it.answer, it.block)
                reqs.append(r)
                handles.append(engine.submit(r))
            w0 = engine.clock()
            if engine.step_once():
                iterations += engine.clock() - w0
            else:
                if clock is None:
                    time.sleep(0.0005)
                elif len(reqs) < len(trace):  # idle: jump to the next arrival
                    clock.advance(max(0.0, t0 + trace[len(reqs)][0] - clock()))
            bar.update(sum(h.done() for h in handles) - bar.n)
        while engine.step_once():  # flush the last releases: the runner's slots are free for the next run
            pass
        bar.close()
        self.last_timing = RunTiming(steps, iterations, engine.clock() - t0)
        self.last_quality = sched.quality()
        return reqs

    def capacity(self) -> tuple[list[float], float]:
        """Idle latency and validity of every pool item at the static τ, and the saturated throughput (req/s)."""
        from tqdm.auto import tqdm

        idle, self.reference = [], []
        for i in tqdm(range(len(self.items)), desc="idle latency", unit="req", file=sys.stderr, leave=False,
                      disable=not self.progress):
            runs = [self.serve("fcfs-static", [(0.0, i, 1e9)])[0] for _ in range(2)]
            idle.append(min(r.finish_time - r.arrival for r in runs))  # min: least disturbed by other load
            valid = [self.valid(r) for r in runs]
            if valid[0] != valid[1]:
                raise RuntimeError(f"item {i}: two idle runs at τ={self.cfg.static_tau} disagree (decoding not deterministic)")
            self.reference.append(valid[0])
        copies = -(-4 * self.cfg.slots // len(self.items))  # enough work that the slots stay full, not tail-bound
        work = [(0.0, i, 1e9) for _ in range(copies) for i in range(len(self.items))]
        reqs = self.serve("fcfs-static", work, "capacity")
        makespan = max(r.finish_time for r in reqs) - min(r.arrival for r in reqs)
        return idle, len(reqs) / makespan

    def valid(self, r) -> bool:
        from dilaserve_jax.tasks.graders import grade

        return bool(grade(self.items[self.index[r.prompt_tokens]].problem, self.model.tokenizer.decode(r.output_tokens or [])))

    def trace(self, rate: float, idle: list[float], seed: int) -> list[tuple[float, int, float]]:
        rng = np.random.default_rng([self.cfg.seed, seed])
        out, t = [], float(rng.exponential(1 / rate))
        while t < self.cfg.duration:
            i = int(rng.integers(len(self.items)))
            out.append((t, i, float(rng.uniform(*self.cfg.slo_range)) * idle[i]))
            t += float(rng.exponential(1 / rate))
        return out

    def records(self, reqs: list) -> list[dict]:
        """Per request: item, task, outcome, τ trajectory, predicted loss, graded validity (and at the
        static τ); the fields `sim.report.summarize` reads, as the simulator's records have them."""
        from dilaserve_jax.serving.policy.request import RequestState

        out = []
        for r in reqs:
            i = self.index[r.prompt_tokens]
            ok = r.state == RequestState.FINISHED_OK
            out.append({"id": r.id, "item": i, "task": self.items[i].problem.task, "state": r.state.name,
                        "arrival": r.arrival, "deadline": r.deadline, "finish": r.finish_time,
                        "latency": r.finish_time - r.arrival if ok else None, "met": bool(r.deadline_met),
                        "steps": len(r.steps), "tau_sum": sum(s.tau for s in r.steps),
                        "committed": sum(s.n_committed for s in r.steps), "taus": [s.tau for s in r.steps],
                        "committed_per_step": [s.n_committed for s in r.steps], "moves": r.moves,
                        "predicted_loss": float(r.predicted_loss), "valid": self.valid(r) if ok else None,
                        "valid_at_static_tau": self.reference[i]})
        return out


def run(cfg: BenchConfig, say, progress: bool) -> tuple[list[dict], dict, dict]:
    bench = Bench(cfg, say, progress)
    bench.build()
    idle, cap = bench.capacity()
    info = {"capacity_rps": cap, "idle_latency_mean": float(np.mean(idle)), "idle_latency_max": float(np.max(idle)),
            "pool": len(bench.items), "pool_skip": cfg.pool_skip, "slots": cfg.slots, "slo_range": list(cfg.slo_range),
            "duration": cfg.duration, "tau_range": [cfg.tau_min, cfg.tau_max], "static_tau": cfg.static_tau,
            "reference_accuracy": float(np.mean(bench.reference)), "latency_model": bench.latency.label,
            "fit": str(bench.latency.report), "clock": cfg.clock,
            "profile_points": [[p.kind.label, p.batch, p.canvas, p.block, p.seconds] for p in bench.profile.points],
            "host_load_at_start": os.getloadavg()[0], "host_cpus": os.cpu_count()}
    say(f"capacity at τ={cfg.static_tau}: {cap:.2f} req/s with {cfg.slots} slots; idle latency mean "
        f"{info['idle_latency_mean'] * 1e3:.0f} ms, max {info['idle_latency_max'] * 1e3:.0f} ms; pool of "
        f"{len(bench.items)} valid at τ={cfg.static_tau}: {100 * info['reference_accuracy']:.1f}%")
    rates = cfg.rates or tuple(round(f * cap, 2) for f in cfg.load_factors)
    floor_of = bench.floor_of()
    if floor_of is not None:
        info["fixed_floor"] = {budget_label(b): floor_of(b) for b in cfg.budgets}
        say("fixed floor per budget (lowest τ whose pooled loss vs τ_max is within it): "
            + ", ".join(f"{k}: {v:g}" for k, v in info["fixed_floor"].items()))
    runs = cfg.runs(floor_of)
    rows, records = [], {}
    for k, rate in enumerate(rates):
        pooled: dict[tuple, list] = {r: [] for r in runs}
        busy = {r: [0.0, 0.0] for r in runs}
        quality: dict[tuple, list] = {r: [] for r in runs}  # the instance's own accounting, per trace
        for t in range(cfg.traces):  # every run serves the same traces; the order rotates
            trace = bench.trace(rate, idle, k if t == 0 else 1000 * t + k)
            shift = (k + t) % len(runs)
            for policy, budget, mode in runs[shift:] + runs[:shift]:
                desc = f"{policy} {mode} {budget_label(budget)} @ {rate:g}/s, trace {t + 1}/{cfg.traces}"
                reqs = bench.serve(policy, trace, desc, budget, mode)
                pooled[(policy, budget, mode)] += [rec | {"trace": t} for rec in bench.records(reqs)]
                busy[(policy, budget, mode)][0] += bench.last_timing.step_s
                busy[(policy, budget, mode)][1] += bench.last_timing.wall_s
                if bench.last_quality is not None:
                    quality[(policy, budget, mode)].append(bench.last_quality.as_dict())
        by_run = {}
        for (policy, budget, mode), recs in pooled.items():
            records[f"{policy}|{mode}|{budget_label(budget)}|{rate:g}"] = recs
            by_run[(policy, budget, mode)] = run_row(policy, budget, mode, rate, recs, quality[(policy, budget, mode)],
                                                     *busy[(policy, budget, mode)], duration=cfg.duration * cfg.traces)
            by_run[(policy, budget, mode)]["host_load"] = os.getloadavg()[0]  # other jobs on the machine
        base = by_run[("fcfs-static", None, "-")]
        base_met = [r["met"] for r in pooled[("fcfs-static", None, "-")]]
        for run_key in runs:
            row = by_run[run_key] | {"load": rate / cap}
            row["slo_gain"] = row["slo_attainment"] - base["slo_attainment"]
            diffs = np.array([int(r["met"]) - int(b) for r, b in zip(pooled[run_key], base_met)], float)
            row["slo_gain_ci"] = 1.96 * float(diffs.std(ddof=1)) / np.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
            row["latency_change"] = row["mean_latency"] / base["mean_latency"] - 1
            row["accuracy_drop"] = base["accuracy"] - row["accuracy"]
            rows.append(row)
            say(format_table([row], header=False))
    return rows, info, records


def _budget(text: str) -> float | None:
    if text.lower() in ("inf", "none", "unbounded"):
        return None
    value = float(text)
    if not (0 <= value < math.inf):
        raise argparse.ArgumentTypeError(f"budget must be points >= 0 or 'inf', got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    d = BenchConfig()
    p = argparse.ArgumentParser(
        prog="python -m dilaserve_jax.bench.policies",
        description="Serve Poisson arrivals of held-out task prompts on one real instance with each scheduling "
                    "policy (fcfs-static, edf-static, and dilaserve at each accuracy-loss budget) at several request "
                    "rates; print SLO attainment, mean/p99 latency, accuracy and its drop vs fcfs-static (paired per "
                    "prompt, with a 95% confidence interval), predicted loss, mean τ and tokens per step.")
    p.add_argument("--model", default=d.model, help="preset or checkpoint directory (default tiny)")
    p.add_argument("--attention", default="auto", choices=("auto", "xla", "pallas"),
                   help="attention implementation (auto = Pallas on GPU/TPU, XLA on CPU)")
    p.add_argument("--rates", type=float, nargs="+", default=None,
                   help="request rates in req/s (default: --load-factors times the measured capacity)")
    p.add_argument("--load-factors", type=float, nargs="+", default=list(d.load_factors),
                   help=f"rates as multiples of the measured capacity (default {' '.join(map(str, d.load_factors))})")
    p.add_argument("--duration", type=float, default=d.duration, help=f"seconds of arrivals per trace (default {d.duration:g})")
    p.add_argument("--traces", type=int, default=d.traces,
                   help=f"Poisson traces per rate, pooled: more requests per point (default {d.traces})")
    p.add_argument("--slo-range", type=float, nargs=2, default=list(d.slo_range), metavar=("LO", "HI"),
                   help="SLO = uniform(LO, HI) x the request's idle latency at the static τ (default 2 6)")
    p.add_argument("--slots", type=int, default=d.slots, help=f"slots of the instance (default {d.slots})")
    p.add_argument("--per-task", type=int, default=d.per_task, help=f"held-out problems per task in the pool (default {d.per_task})")
    p.add_argument("--pool-skip", type=int, default=d.pool_skip,
                   help=f"skip the first N held-out problems per task, the eval rows' sample (default {d.pool_skip})")
    p.add_argument("--tau-min", type=float, default=d.tau_min, help=f"dilaserve quality floor (default {d.tau_min})")
    p.add_argument("--tau-max", type=float, default=d.tau_max, help=f"dilaserve ceiling (default {d.tau_max})")
    p.add_argument("--max-accuracy-drop", type=_budget, nargs="+", default=list(d.budgets), metavar="PTS",
                   help="dilaserve accuracy-loss budgets to sweep, points vs τ_max, 'inf' = unbounded "
                        "(default 0 0.5 1 2 5 inf)")
    p.add_argument("--no-floor-baseline", action="store_true",
                   help="skip the fixed-floor baseline runs (lowest τ within budget for everyone)")
    p.add_argument("--prior", default=None, help="eval --json rows: the τ -> tokens/step and τ -> accuracy priors")
    p.add_argument("--profile", default=None,
                   help="latency profile JSON for the schedulers and the modeled clock (default: measured at start)")
    p.add_argument("--profile-passes", type=int, default=d.profile_passes,
                   help=f"profile passes; each shape keeps its fastest (default {d.profile_passes})")
    p.add_argument("--save-profile", default=None, metavar="PATH",
                   help="write the profile measured at start-up (rerun with --profile PATH --clock modeled to "
                        "repeat a run exactly)")
    p.add_argument("--seed", type=int, default=d.seed, help="workload seed (default 0)")
    p.add_argument("--clock", default=d.clock, choices=CLOCKS,
                   help="real: serve in real time (default); modeled: real steps, virtual clock advanced by each "
                        "step's profiled time (reproducible, untouched by other load; scheduling time not counted)")
    p.add_argument("--json", action="store_true",
                   help="print the rows, the capacity info and every request's record (τ trajectory, graded "
                        "validity, predicted loss) as JSON instead of the table")
    p.add_argument("--plot", default=None, help="write attainment and mean latency vs rate to this PNG")
    p.add_argument("--pareto", default=None, help="write SLO gain vs measured accuracy drop (per budget) to this PNG")
    p.add_argument("--compile-cache", default=os.path.join(os.path.expanduser("~"), ".cache", "dilaserve_jax", "xla"),
                   help="persistent XLA compilation cache directory, or 'none'")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    try:
        cfg = BenchConfig(model=args.model, rates=tuple(args.rates or ()), load_factors=tuple(args.load_factors),
                          duration=args.duration, traces=args.traces, slo_range=tuple(args.slo_range), slots=args.slots,
                          per_task=args.per_task, pool_skip=args.pool_skip, tau_min=args.tau_min, tau_max=args.tau_max,
                          budgets=tuple(dict.fromkeys(args.max_accuracy_drop)),
                          floor_baseline=not args.no_floor_baseline, prior=args.prior, profile=args.profile,
                          save_profile=args.save_profile, profile_passes=args.profile_passes, seed=args.seed, attention=args.attention,
                          clock=args.clock)
        from dilaserve_jax.decoding.compiled import enable_compile_cache

        enable_compile_cache(args.compile_cache)
        rows, info, records = run(cfg, say, not args.no_progress)
    except (ValueError, FileNotFoundError) as err:
        say(f"error: {err}")
        return 2
    report = f"{format_table(rows)}\n{headline(rows)}"
    if args.json:  # the table and headline still go to stderr
        print(json.dumps({"info": info, "rows": rows, "requests": records}))
        say(report)
    else:
        print(report)
    if args.plot:
        plot_rates(rows, info, args.plot)
        say(f"wrote {args.plot}")
    if args.pareto:
        plot_pareto(rows, args.pareto)
        say(f"wrote {args.pareto}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
