"""A host factory over fake runners (tests, the leader-throughput benchmark): no model, no JAX.

Each host has `instances` fake devices and starts with one TP-1 engine on each (its builder
reshapes them into any power-of-two layout); their steps really sleep (`step_s` a reuse step, four
times that a refresh), emitting lower-case letters so answers decode as text. Their tokens
depend only on the prompt and the position, so an answer is the same whichever host or how many
hosts ran it — what lets tests check that moving requests between hosts changes nothing.

Their "weights" are one number (the fake runner's): a reload from a directory with step N makes
every later token depend on N (`letter_answer(..., weights=N)`); a directory holding a file
`unreadable-on-<host>` cannot be loaded on that host, for tests of a reload that fails on one.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from dilaserve_jax.core.kinds import StepKind
from dilaserve_jax.core.layouts import instance_name, parse_layout, placements
from dilaserve_jax.serving.cluster.builder import InstanceInfo
from dilaserve_jax.serving.cluster.engine import Engine
from dilaserve_jax.serving.cluster.fake_runner import FakeRunner, fake_tp_profile
from dilaserve_jax.serving.cluster.hosts.worker import HostBuild
from dilaserve_jax.serving.cluster.weights_swap import NewWeights, WeightsError
from dilaserve_jax.serving.policy.hosts_controller import ControlInputs
from dilaserve_jax.serving.policy.latency import LatencyModel
from dilaserve_jax.serving.policy.scheduler import Scheduler, SchedulerConfig
from dilaserve_jax.serving.policy.threshold_config import DEFAULT_PRIOR

FAKE_PARAM_BYTES = 64 * 2**20  # what the controller prices a fake host's resharding at


class LetterFakeRunner(FakeRunner):
    """The fake runner, committing printable letters (97 + t % 26)."""

    def _advance(self, slot, st, tau):
        out = super()._advance(slot, st, tau)
        tokens = tuple(97 + t % 26 for t in out.tokens)
        for p, t in zip(out.positions, tokens):
            st.tokens[p] = t
        answer = tuple(t for t in st.tokens if t is not None) if out.request_finished else None
        return type(out)(out.slot, out.positions, tokens, out.n_committed, out.max_confidence,
                         out.block_finished, out.request_finished, answer=answer)


def letter_answer(prompt, answer_length: int, weights: int = 0) -> tuple[int, ...]:
    """What LetterFakeRunner commits for a prompt, wherever and in how many pieces it ran."""
    return tuple(97 + (10 + (sum(prompt) * 31 + p * 7 + weights * 13) % 1000) % 26 for p in range(answer_length))


@dataclass(frozen=True, slots=True)
class FakeHostFactory:
    instances: int = 2  # devices of each host; it starts with one TP-1 instance on each
    slots: int = 4
    step_s: float = 0.002  # a reuse step; a refresh takes four times as long
    policy: str = "fcfs-static"
    max_queue: int = 256
    tokenizer: Any = None  # what the leader's frontends decode with (the CharTokenizer in tests)
    limits: Any = None  # the frontends' request limits

    def build(self, host: str) -> HostBuild:
        builder = FakeHostBuilder(self)
        infos = builder.plan(f"{self.instances}x1")
        engines, _, _ = builder.build(infos, f"{self.instances}x1")
        return HostBuild(engines, [dataclasses.replace(i, host=host) for i in infos], self.tokenizer, self.limits,
                         self.policy, "fake", "fake", builder=builder, control=builder.control_inputs,
                         weights=FakeHostWeights(host, builder))


class FakeHostBuilder:
    """The InstanceBuilder contract over a host's fake devices: any power-of-two partition of them."""

    def __init__(self, factory: FakeHostFactory) -> None:
        self.factory = factory
        self.latency = LatencyModel.from_profile(fake_tp_profile())
        self.weights = 0  # what new instances are built with
        self.names: list[str] = []  # the instances now

    def control_inputs(self) -> ControlInputs:
        n = self.factory.instances
        tps = tuple(t for t in self.latency.tp_degrees if t <= n)
        return ControlInputs(n, tps, {t: self.latency for t in tps}, self.factory.slots, FAKE_PARAM_BYTES, 0.5,
                             dict(DEFAULT_PRIOR))

    def plan(self, spec: str) -> list[InstanceInfo]:
        tps = parse_layout(spec)
        if sum(tps) != self.factory.instances:
            raise ValueError(f"layout {spec} does not cover this host's {self.factory.instances} devices")
        out = []
        for tp, first in placements(tps):
            ids = tuple(range(first, first + tp))
            out.append(InstanceInfo(instance_name(ids), tp, ids))
        return out

    def overlap_fits(self, add: Sequence[InstanceInfo]) -> bool:
        return True

    def build(self, add: Sequence[InstanceInfo], spec: str) -> tuple[list[Engine], int, float]:
        f, step_s = self.factory, self.factory.step_s

        def step_time(kind, batch, canvas, block):
            return step_s * (4 if kind == StepKind.REFRESH else 1)

        engines = []
        for info in add:
            runner = LetterFakeRunner(f.slots, real_sleep=True, tp_degree=info.tp_degree, step_time=step_time)
            runner.weights = self.weights
            cfg = SchedulerConfig(num_slots=f.slots, policy=f.policy, max_queue=f.max_queue, tp=info.tp_degree)
            engines.append(Engine(runner, Scheduler(cfg, self.latency), clock=time.monotonic, name=info.name))
        self.names = [*self.names, *(i.name for i in add if i.name not in self.names)]
        return engines, 0, 0.0

    def prepare(self, engine: Engine) -> None:
        pass

    def release(self, names: Sequence[str]) -> None:
        self.names = [n for n in self.names if n not in set(names)]

    def compiled_placements(self) -> frozenset[tuple[int, int]]:
        return frozenset()


class FakeHostWeights:
    """A fake host's reloads: the weights of step N of an existing directory are the number N."""

    def __init__(self, host: str, builder: FakeHostBuilder) -> None:
        self.host, self.builder, self._before = host, builder, 0

    def load(self, source: str, step: int | None) -> NewWeights:
        directory = Path(source)
        if not directory.is_dir():
            raise WeightsError(f"cannot load weights from {source!r}: not a directory")
        if (directory / f"unreadable-on-{self.host}").exists():
            raise WeightsError(f"cannot load weights from {source!r} on host {self.host}")
        self._before, self.builder.weights = self.builder.weights, step or 0
        return NewWeights(f"fake:{source}@{step or 0}", {name: self.builder.weights for name in self.builder.names})

    def undo(self) -> None:
        self.builder.weights = self._before

    def settle(self) -> None:
        self._before = self.builder.weights
