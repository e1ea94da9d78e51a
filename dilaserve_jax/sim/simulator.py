"""The event loop: arrivals, instance iterations, switches and control rounds on virtual time.

`Simulation(cfg, ...).run()` replays a list of `RequestSpec`s through a `SimCluster` of real
`Engine`s (real `Scheduler`, `ThresholdController`, `Router`; for dilaserve the real
`ClusterController` driven by the real `Autoscaler.round`) over modelled runners, and returns one
record per request. Events at equal times run arrivals first, then switches, control rounds and
instance iterations; each instance iterates at the end of its previous step, so instances step
concurrently and the loop always advances to the next completion.
"""
from __future__ import annotations

import sys
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

from dilaserve_jax.core.layouts import binary_partitions, is_schedule, layout_text, parse_layout, parse_schedule
from dilaserve_jax.serving.cluster.autoscale import Autoscaler
from dilaserve_jax.serving.cluster.builder import InstanceInfo
from dilaserve_jax.serving.policy.capacity import RequestShape, StepShapes
from dilaserve_jax.serving.policy.controller import ClusterController
from dilaserve_jax.serving.cluster.engine import Engine
from dilaserve_jax.serving.cluster.engine_types import RequestResult
from dilaserve_jax.serving.cluster.iteration_trace import IterationTracer
from dilaserve_jax.serving.policy.latency import LatencyModel
from dilaserve_jax.serving.policy.layout_eval import LayoutPrediction
from dilaserve_jax.serving.policy.request import Request, RequestState
from dilaserve_jax.serving.policy.scheduler import OVERLOAD_RULES, OVERLOAD_RULES_OFF, Scheduler, SchedulerConfig
from dilaserve_jax.serving.policy.threshold import ThresholdConfig
from dilaserve_jax.sim.cluster import ARRIVAL, CONTROL, SWITCH, SimCluster, SimInstance, SwitchCost
from dilaserve_jax.sim.executor import ModelledRunner, StepTimeModel, VirtualClock
from dilaserve_jax.sim.host_time import HostTimeModel
from dilaserve_jax.sim.policies import threshold_controller_class
from dilaserve_jax.sim.quality import QualityModel, RequestPlan, make_plan
from dilaserve_jax.sim.sim_config import SimConfig
from dilaserve_jax.sim.step_stats import StepStats
from dilaserve_jax.sim.workload import RequestSpec


@dataclass(frozen=True, slots=True)
class RequestRecord:
    id: str
    task: str
    arrival: float
    deadline: float
    finish: float | None
    state: str  # RequestState name, or "FAILED"
    met: bool
    steps: int
    tau_sum: float
    committed: int
    low_tau_positions: int  # positions committed below the quality model's published range
    valid: bool | None
    moves: int
    instance: str
    predicted_loss: float = 0.0  # accuracy points the serving budget charged its τ trajectory
    valid_p: float | None = None  # the quality model's P(valid) at the τ it ran (`valid` is a draw of it)
    valid_p_ref: float | None = None  # the same at its τ_max throughout: the paired reference for the drop

    @property
    def latency(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival


@dataclass
class SimResult:
    config: SimConfig
    records: list[RequestRecord]
    wall_s: float
    sim_s: float
    reconfigurations: list
    migrations: dict[str, int]
    layouts: list[tuple[float, str]]  # (time, layout) from the start
    decisions: int = 0
    quality: str = ""
    extrapolated_below: float = 0.0
    step_stats: StepStats | None = None  # the modelled runners' steps (None with a runner_factory)


class Simulation:
    def __init__(self, cfg: SimConfig, specs: Sequence[RequestSpec], *, step_time: StepTimeModel | None,
                 latency: LatencyModel, quality: QualityModel | None, prior: Mapping[float, float] | None,
                 param_bytes: float, progress: bool = False, label: str = "",
                 runner_factory: Callable[[InstanceInfo, VirtualClock], object] | None = None,
                 eval_rows: Sequence[Mapping] | None = None, host_time: HostTimeModel | None = None,
                 trace: bool = False) -> None:
        """`runner_factory(info, clock)` replaces the modelled runner (tests drive the fake runner);
        without it `step_time` and `quality` are required. `eval_rows` (`tasks.eval --json` format;
        `QualityModel.eval_rows()`): the threshold controller's speed prior and accuracy budget, built
        by the serving code (`ThresholdConfig.from_eval`, `cfg.max_accuracy_drop`); without them the
        `prior` alone and no budget. `host_time`: host seconds per iteration on (batch, queue), charged
        with each step (`sim/host_time.py`). `trace`: record every engine iteration (`traces`, per
        instance name; `serving/cluster/iteration_trace.py`)."""
        if runner_factory is None and (step_time is None or quality is None):
            raise ValueError("the modelled runner needs a step-time model and a quality model")
        self.cfg, self.specs = cfg, list(specs)
        self.step_time, self.latency, self.quality = step_time, latency, quality
        self.prior = dict(prior) if prior else None
        self.param_bytes, self.progress, self.label = param_bytes, progress, label or cfg.name
        self.plans: dict[int, RequestPlan] = {}
        self.records: list[RequestRecord] = []
        if eval_rows:
            self._tcfg = ThresholdConfig.from_eval(list(eval_rows), max_accuracy_drop=cfg.max_accuracy_drop,
                                                   budget_mode=cfg.budget_mode)
            self.prior = dict(self._tcfg.prior)
        else:
            self._tcfg = ThresholdConfig.with_prior(self.prior) if self.prior else ThresholdConfig()
        self._tclass = threshold_controller_class(cfg.ablate) if cfg.policy == "dilaserve" else None
        self.hooks: list = []  # step hooks added to every engine (tests)
        self.runner_factory = runner_factory
        self.host_time = host_time
        self.step_stats = StepStats() if runner_factory is None else None
        self.traces: dict[str, IterationTracer] | None = {} if trace else None

    # --- construction ---
    def make_instance(self, info: InstanceInfo, t: float) -> SimInstance:
        cfg = self.cfg
        clock = VirtualClock(t)
        if self.runner_factory is not None:
            runner = self.runner_factory(info, clock)
        else:
            runner = ModelledRunner(cfg.slots, info.tp_degree, clock, self.step_time, self.quality, self.plans,
                                    seed=cfg.seed * 1009 + info.device_ids[0], host_time=self.host_time,
                                    stats=self.step_stats)
        ctl = self._tclass(self._tcfg) if self._tclass is not None else None
        sched = Scheduler(SchedulerConfig(cfg.slots, policy=cfg.policy, tp=info.tp_degree, static_tau=cfg.static_tau,
                                          max_queue=cfg.max_queue, threshold=self._tcfg,
                                          run_ahead=cfg.run_ahead, preempt_at_risk=cfg.preempt_at_risk,
                                          **(OVERLOAD_RULES if cfg.overload_rules else OVERLOAD_RULES_OFF)),
                          self.latency, ctl)
        engine = Engine(runner, sched, clock=clock, name=info.name)
        if hasattr(runner, "queue_depth"):
            runner.queue_depth = lambda: len(sched.waiting)
        if self.traces is not None:
            engine.tracer = self.traces[info.name] = IterationTracer(
                clock, (lambda: runner.last_host_s) if hasattr(runner, "last_host_s") else None)
        for hook in self.hooks:
            engine.add_step_hook(hook)
        return SimInstance(info, engine, clock)

    def _candidates(self) -> list[tuple[int, ...]]:
        tps = [t for t in self.cfg.tp_degrees if t <= self.cfg.devices]
        if self.cfg.layouts:
            return [parse_layout(x) for x in self.cfg.layouts]
        return binary_partitions(self.cfg.devices, tps)

    def _controller(self, layouts: Sequence[tuple[int, ...]]) -> ClusterController:
        ccfg = self.cfg.controller
        if "migration" in self.cfg.ablate:
            ccfg = replace(ccfg, max_migrations=0)
        tps = sorted({t for lay in layouts for t in lay})
        quality = self._tcfg.quality if self.cfg.policy == "dilaserve" else None
        # layouts are priced down to the budget's floor, as serve prices them (`build.tau_floor`)
        floor = self.cfg.tau_min if quality is None else \
            quality.free_floor(self.cfg.tau_min, self.cfg.tau_max, self._tcfg.grid)
        return ClusterController(ccfg, num_devices=self.cfg.devices, tp_degrees=tps, latency=self.latency,
                                 slots=self.cfg.slots, param_bytes=int(self.param_bytes), layouts=list(layouts),
                                 tau_floor=floor, prior=self.prior,
                                 pressure_share=None if quality is None else self._tcfg.pressure_at_risk_share,
                                 shapes=StepShapes(getattr(self.step_time, "length_buckets", ()),
                                                   getattr(self.step_time, "batch_buckets", ())))

    def first_window_predictions(self) -> tuple[list[RequestSpec], list[LayoutPrediction]]:
        """(the arrivals of the first controller window, the controller's prediction for every candidate
        layout from them, as it measures the load after that window); ([], []) without arrivals there."""
        first = [s for s in self.specs if s.arrival < self.cfg.controller.window_s]
        if not first:
            return [], []
        controller = self._controller(self._candidates())
        for s in first:
            controller.observe(_shape(s, self.cfg), s.arrival)
        rate, sample = controller.load(first[-1].arrival)
        return first, controller.predict(rate, sample, spread=controller.spread(first[-1].arrival, sample))

    def initial_layout(self) -> str:
        cfg = self.cfg
        if is_schedule(cfg.layout):
            return parse_schedule(cfg.layout)[0][1]
        if cfg.layout != "auto":
            return cfg.layout
        if cfg.initial_layout:
            return cfg.initial_layout
        first, preds = self.first_window_predictions()
        if not first:
            return layout_text(self._candidates()[0])
        ref = min(p.latency_s for p in preds)
        k = cfg.controller.refine_candidates
        if k and self.runner_factory is None:  # the shortlist as it replays (sim/refine.py)
            from dilaserve_jax.sim.refine import ReplayRefiner

            preds.sort(key=lambda p: cfg.controller.value(p.attainment, p.tau, p.latency_s, ref), reverse=True)
            preds = list(ReplayRefiner(self)([p.layout for p in preds[:k]], [(s.arrival, _shape(s, cfg))
                                                                             for s in first], first[-1].arrival))
            ref = min(p.latency_s for p in preds)
        best = max(preds, key=lambda p: cfg.controller.value(p.attainment, p.tau, p.latency_s, ref))
        return layout_text(best.layout)

    # --- the run ---
    def run(self) -> SimResult:
        cfg = self.cfg
        t_wall = time.perf_counter()
        start = self.initial_layout()
        cost = SwitchCost(self.param_bytes, cfg.controller.bandwidth_gbps, cfg.controller.compile_s,
                          cfg.controller.load_s)
        by_degree = cfg.compile_cache == "by-degree"
        degrees = sorted({t for lay in self._candidates() for t in lay}) if by_degree else ()
        cluster = SimCluster(cfg.devices, start, self.make_instance, cost, policy=cfg.policy,
                             model=self.quality.name if self.quality is not None else "",
                             compiled_degrees=degrees, compile_by_degree=by_degree)
        self.cluster = cluster
        scaler = None
        if cfg.policy == "dilaserve":
            fixed = "reconfig" in cfg.ablate or cfg.layout != "auto"
            ctl = self._controller([parse_layout(start)] if fixed else self._candidates())
            if not fixed and cfg.controller.refine_candidates:
                if self.runner_factory is not None:
                    raise ValueError("refinement by replay needs the modelled runner")
                from dilaserve_jax.serving.policy.refinement import Refinement
                from dilaserve_jax.sim.refine import ReplayRefiner

                ctl.refinement = Refinement(cfg.controller, ReplayRefiner(self))
            scaler = cluster.autoscaler = Autoscaler(cluster, ctl, mode="manual", clock=lambda: cluster.now)
            cluster.push(cfg.controller.interval_s, CONTROL, None)
        schedule = parse_schedule(cfg.layout)[1:] if is_schedule(cfg.layout) else []
        for k, (t, _) in enumerate(schedule):
            cluster.push(t, SCHEDULED, None, k)
        layouts = [(0.0, cluster.layout)]
        n = len(self.specs)
        done = [0]
        if n:
            cluster.push(self.specs[0].arrival, ARRIVAL, None, 0)
        bar = _progress(n, self.label, self.progress)
        outstanding = [0]

        def arrival(t, _, i):
            self._arrive(cluster, i, outstanding, done)
            if i + 1 < n:
                cluster.push(self.specs[i + 1].arrival, ARRIVAL, None, i + 1)

        def control(t, _, __):
            if done[0] < n and not cluster.has_events(other_than=CONTROL):
                # no arrival, step or switch left to come, yet requests unfinished: nothing can
                # finish them (a lost request); say so instead of ticking the clock forever
                lost = sorted(cluster.where)
                raise RuntimeError(f"simulation stalled at {t:.1f} s: {n - done[0]} request(s) unfinished with "
                                   f"no work left to run ({', '.join(lost[:5]) or 'placed nowhere'})")
            if outstanding[0] or done[0] < n:
                if not cluster.switching:
                    scaler.round(t)
                cluster.push(t + cfg.controller.interval_s, CONTROL, None)

        def scheduled(t, _, k):
            """A switch the schedule names: taken at its time, or as soon as a switch under way ends."""
            if cluster.switching:
                cluster.push(t + 0.25, SCHEDULED, None, k)
                return
            spec = schedule[k][1]
            cluster.reconfigure(spec, reason="schedule")
            if scaler is not None:  # migrations within the new layout, as a fixed layout's controller makes
                scaler.controller = self._controller([parse_layout(spec)])

        handlers = {ARRIVAL: arrival, CONTROL: control, SCHEDULED: scheduled}
        while (ev := cluster.process_next(handlers)) is not None:
            if ev[1] == SWITCH:
                layouts.append((ev[0], cluster.layout))
            if bar is not None and done[0] != bar.n:
                bar.update(done[0] - bar.n)
                bar.set_postfix_str(f"t={ev[0]:.0f}s {cluster.layout}", refresh=False)
        if bar is not None:
            bar.close()
        ctl = scaler.controller if scaler is not None else None
        q = self.quality
        return SimResult(cfg, self.records, time.perf_counter() - t_wall, cluster.now, cluster.reconfigurations,
                         dict(cluster.migrations), layouts, len(ctl.history) if ctl is not None else 0,
                         (q.source or q.name) if q is not None else "", q.extrapolated_below if q is not None else 0.0,
                         self.step_stats)

    def make_request(self, i: int) -> Request:
        """The i-th request of the workload; its seed (i + 1) keys its plan in the modelled runner."""
        s = self.specs[i]
        return Request(f"r{i}", s.prompt_tokens, s.answer_length, s.block_length, s.arrival, s.arrival + s.slo,
                       tau_min=self.cfg.tau_min, tau_max=self.cfg.tau_max, seed=i + 1)

    def _arrive(self, cluster: SimCluster, i: int, outstanding: list[int], done: list[int]) -> None:
        """The i-th request arrives, at the cluster's virtual time."""
        s = self.specs[i]
        key = i + 1
        if self.quality is not None:
            self.plans[key] = make_plan(self.quality, key, s.task, s.answer_length, s.block_length, s.finish_tokens,
                                        s.prompt_tokens)
        req = self.make_request(i)
        outstanding[0] += 1

        def finished(f: Future, req=req, key=key, task=s.task) -> None:
            outstanding[0] -= 1
            done[0] += 1
            self._record(req, key, task, f)

        cluster.submit(req).future.add_done_callback(finished)

    def _record(self, req: Request, key: int, task: str, fut: Future) -> None:
        plan = self.plans.pop(key, None)
        err = fut.exception()
        res: RequestResult | None = None if err is not None else fut.result()
        state = "FAILED" if res is None else res.state.name
        valid = p = p_ref = None
        low = 0
        steps = [(s.tau, s.n_committed) for s in req.steps]
        if res is not None and res.state == RequestState.FINISHED_OK and plan is not None:
            p = self.quality.valid_probability(plan, steps)
            valid = self.quality.uniform(key, 5) < p
            p_ref = self.quality.valid_probability(plan, [(req.tau_max, 1)])
        if self.quality is not None and self.quality.extrapolated_below:
            low = sum(n for tau, n in steps if tau < self.quality.extrapolated_below - 1e-9)
        self.records.append(RequestRecord(
            req.id, task, req.arrival, req.deadline, req.finish_time, state, bool(res and res.deadline_met),
            len(steps), sum(tau for tau, _ in steps), sum(n for _, n in steps), low, valid, req.moves,
            res.instance if res is not None else "", float(req.predicted_loss), p, p_ref))


SCHEDULED = 4  # an event kind of the simulator's own (after the cluster's four)


def _shape(s: RequestSpec, cfg: SimConfig) -> RequestShape:
    return RequestShape(len(s.prompt_tokens), s.answer_length, s.block_length, s.slo, cfg.tau_min, cfg.tau_max)


def _progress(total: int, label: str, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=label, unit="req", file=sys.stderr, leave=False, dynamic_ncols=True)
