"""The policies benchmark's serving side: the pool of held-out prompts, the start-up profile and one
serving run of a trace on a fresh scheduler (`Bench.serve`), in real time or on the modeled clock
(`ProfiledTimeRunner`). Its configuration (`BenchConfig`, whose fields are `bench.policies`' flags)
is in `bench/policies_config.py`, its arrivals and SLOs in `bench/policies_workload.py`.
`bench.policies` sweeps it over rates and policies; `bench.sim_validate` replays its runs in the
simulator.
"""
from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass

from dilaserve_jax.bench.policies_config import BenchConfig, ShippedDefaults
from dilaserve_jax.bench.policies_workload import Workload
from dilaserve_jax.core.buckets import bucket_for, slot_buckets

log = logging.getLogger(__name__)


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


class Bench:
    """The pool, the instance and its profile, and serving runs on it. Status lines go to `logger`
    (the calling command's, so they print as its own lines; default this module's)."""

    def __init__(self, cfg: BenchConfig, progress: bool = True, logger: logging.Logger | None = None):
        from dilaserve_jax.models import load_model
        from dilaserve_jax.tasks.suite import TASKS, task_block, unique_problems

        self.cfg, self.progress, self.log = cfg, progress, logger or log
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
        self.workload = Workload([it.problem.task for it in self.items], duration=cfg.duration,
                                 slo_range=cfg.slo_range, slo_factor=cfg.slo_factor, trace=cfg.trace,
                                 trace_min_generated=cfg.trace_min_generated, seed=cfg.seed)
        self._shipped: ShippedDefaults | None = None

    def _eval_rows(self) -> list[dict] | None:
        from dilaserve_jax.serving.policy.eval_rows import describe_priors, eval_rows_beside, read_eval_rows

        path = self.cfg.prior or eval_rows_beside(self.model.source)
        if path is None:
            self.log.info("no eval rows (pass --prior eval.json): built-in speed prior, no accuracy model, "
                          "accuracy budgets not enforced")
            return None
        rows = read_eval_rows(path)
        self.log.info(f"threshold priors from {path}: {describe_priors(rows)}")
        return rows

    def threshold_config(self, budget: float | None, mode: str):
        from dilaserve_jax.serving.policy.threshold import ThresholdConfig

        if self.rows is None:
            return ThresholdConfig()
        return ThresholdConfig.from_eval(self.rows, max_accuracy_drop=budget, budget_mode=mode if mode != "-" else "adaptive")

    def shipped(self) -> ShippedDefaults:
        """serve's defaults on this model: resolved once by serve's own code (τ ceiling, budget, rows)."""
        if self._shipped is None:
            from dilaserve_jax.serving.executor.build import ServeConfig, resolve_threshold

            threshold, serve = resolve_threshold(ServeConfig(model=self.cfg.model, prior=self.cfg.prior),
                                                 self.model.source, lambda line: self.log.info(f"serve: {line}"))
            self._shipped = ShippedDefaults(serve.policy, serve.tau_min, serve.tau_max, serve.max_accuracy_drop,
                                            serve.budget_mode, serve.admission, threshold)
        return self._shipped

    def floor_of(self):
        """budget -> the fixed floor at this benchmark's τ range (None without an accuracy model)."""
        if self.rows is None:
            return None
        from dilaserve_jax.serving.policy.accuracy import AccuracyModel
        from dilaserve_jax.serving.policy.threshold_config import TAU_GRID

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
            self.log.info(f"wrote the measured profile to {cfg.save_profile}")
        self.profile = Profile.load(cfg.profile) if cfg.profile else measured
        self.latency = LatencyModel.from_profile(self.profile)
        self.step_seconds = {(p.kind, p.batch, p.canvas, p.block): p.seconds for p in self.profile.points}
        source = cfg.profile or f"{len(points)} points measured now ({label})"
        self.log.info(f"latency model{' and modeled step times' if cfg.clock == 'modeled' else ''} from {source}; "
                      f"fit {self.latency.report}")
        self.log.info(f"compiled and profiled in {time.perf_counter() - t0:.1f} s")

    # --- one serving run ---
    def serve(self, policy: str, trace: list[tuple[float, int, float]], desc: str = "", budget: float | None = None,
              mode: str = "-") -> list:
        """Serve (arrival offset, item index, slo) on a fresh scheduler; returns the finished requests.
        Where the time went is left in `last_timing`, every engine iteration in `last_trace`
        (`IterationRecord`s), the instance's own quality accounting in `last_quality`."""
        from tqdm.auto import tqdm

        from dilaserve_jax.serving.cluster.engine import Engine
        from dilaserve_jax.serving.cluster.iteration_trace import IterationTracer
        from dilaserve_jax.serving.policy.request import make_request
        from dilaserve_jax.serving.policy.scheduler import Scheduler, SchedulerConfig

        cfg = self.cfg
        if mode == "defaults":  # as serve builds an instance's scheduler (the queue bound is the benchmark's)
            ship = self.shipped()
            tau_min, tau_max = ship.tau_min, ship.tau_max
            sched_cfg = SchedulerConfig(cfg.slots, policy=ship.policy, max_queue=10_000, admission=ship.admission,
                                        threshold=ship.threshold)
        else:
            tau_min, tau_max = cfg.tau_min, cfg.tau_max
            sched_cfg = SchedulerConfig(cfg.slots, policy=policy, static_tau=cfg.static_tau, max_queue=10_000,
                                        admission=cfg.admission if policy == "dilaserve" else "best-effort",
                                        threshold=self.threshold_config(budget, mode))
        sched = Scheduler(sched_cfg, self.latency)
        if cfg.clock == "modeled":
            from dilaserve_jax.serving.cluster.fake_runner import FakeClock

            clock = FakeClock()
            engine = Engine(ProfiledTimeRunner(self.runner, clock, self.step_seconds, self.latency), sched, clock=clock)
        else:
            clock = None
            engine = Engine(self.runner, sched)
        engine.tracer = tracer = IterationTracer(engine.clock)
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
                                 tau_min=tau_min, tau_max=tau_max)
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
        self.last_trace = tracer.records
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
        # enough work that the slots stay full, not tail-bound, in the workload's mix of prompts
        work = [(0.0, i, 1e9) for i in self.workload.capacity_items(4 * self.cfg.slots)]
        reqs = self.serve("fcfs-static", work, "capacity")
        makespan = max(r.finish_time for r in reqs) - min(r.arrival for r in reqs)
        return idle, len(reqs) / makespan

    def valid(self, r) -> bool:
        from dilaserve_jax.tasks.graders import grade

        return bool(grade(self.items[self.index[r.prompt_tokens]].problem, self.model.tokenizer.decode(r.output_tokens or [])))

    def trace(self, rate: float, idle: list[float], seed: int) -> list[tuple[float, int, float]]:
        """(arrival offset, pool index, SLO) of one trace at `rate` (see `bench/policies_workload.py`)."""
        return self.workload.trace(rate, idle, seed)

    def records(self, reqs: list) -> list[dict]:
        """Per request: item, task, outcome, τ trajectory, predicted loss, graded validity (and at the
        static τ); the fields `sim.report.summarize` reads, as the simulator's records have them."""
        from dilaserve_jax.serving.policy.request import RequestState

        out = []
        for r in reqs:
            i = self.index[r.prompt_tokens]
            ok = r.state == RequestState.FINISHED_OK
            out.append({"id": r.id, "item": i, "task": self.items[i].problem.task, "state": r.state.name,
                        "arrival": r.arrival, "start": r.start_time, "deadline": r.deadline, "finish": r.finish_time,
                        "latency": r.finish_time - r.arrival if ok else None, "met": bool(r.deadline_met),
                        "steps": len(r.steps), "tau_sum": sum(s.tau for s in r.steps),
                        "committed": sum(s.n_committed for s in r.steps), "taus": [s.tau for s in r.steps],
                        "committed_per_step": [s.n_committed for s in r.steps], "moves": r.moves,
                        "predicted_loss": float(r.predicted_loss), "valid": self.valid(r) if ok else None,
                        "valid_at_static_tau": self.reference[i]})
        return out
