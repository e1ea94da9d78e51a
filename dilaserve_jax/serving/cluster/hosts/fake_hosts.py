"""A host factory over fake runners (tests, the leader-throughput benchmark): no model, no JAX.

Each host gets `instances` TP-1 engines whose steps really sleep (`step_s` a reuse step, four
times that a refresh), emitting lower-case letters so answers decode as text. Their tokens
depend only on the prompt and the position, so an answer is the same whichever host or how many
hosts ran it — what lets tests check that moving requests between hosts changes nothing.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from dilaserve_jax.core.kinds import StepKind
from dilaserve_jax.serving.cluster.builder import InstanceInfo
from dilaserve_jax.serving.cluster.engine import Engine
from dilaserve_jax.serving.cluster.fake_runner import FakeRunner, fake_profile
from dilaserve_jax.serving.cluster.hosts.worker import HostBuild
from dilaserve_jax.serving.policy.latency import LatencyModel
from dilaserve_jax.serving.policy.scheduler import Scheduler, SchedulerConfig


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


def letter_answer(prompt, answer_length: int) -> tuple[int, ...]:
    """What LetterFakeRunner commits for a prompt, wherever and in how many pieces it ran."""
    return tuple(97 + (10 + (sum(prompt) * 31 + p * 7) % 1000) % 26 for p in range(answer_length))


@dataclass(frozen=True, slots=True)
class FakeHostFactory:
    instances: int = 2
    slots: int = 4
    step_s: float = 0.002  # a reuse step; a refresh takes four times as long
    policy: str = "fcfs-static"
    max_queue: int = 256
    tokenizer: Any = None  # what the leader's frontends decode with (the CharTokenizer in tests)
    limits: Any = None  # the frontends' request limits

    def build(self, host: str) -> HostBuild:
        latency = LatencyModel.from_profile(fake_profile())
        step_s = self.step_s

        def step_time(kind, batch, canvas, block):
            return step_s * (4 if kind == StepKind.REFRESH else 1)

        engines, infos = [], []
        for i in range(self.instances):
            runner = LetterFakeRunner(self.slots, real_sleep=True, step_time=step_time)
            cfg = SchedulerConfig(num_slots=self.slots, policy=self.policy, max_queue=self.max_queue)
            name = f"instance-{i}"
            engines.append(Engine(runner, Scheduler(cfg, latency), clock=time.monotonic, name=name))
            infos.append(InstanceInfo(name, 1, (i,), host))
        return HostBuild(engines, infos, self.tokenizer, self.limits, self.policy, "fake", "fake")
