"""JaxRunner: the real `Runner` — jitted, slot-batched diffusion steps on one instance.

A thin adapter over `decoding.SlotDecoder` (which already speaks StepKind and returns
SlotOutcome): it adds the TP degree, placement (params and state sharding) and weight reload.
"""
from __future__ import annotations

from typing import Any, Sequence

from dilaserve_jax.core.kinds import CacheMode, StepKind
from dilaserve_jax.core.outcome import SlotOutcome
from dilaserve_jax.decoding.compiled import CompiledSteps
from dilaserve_jax.decoding.decoder import DecoderConfig, SlotDecoder
from dilaserve_jax.models.config import ModelConfig


class JaxRunner:
    """Implements `serving.policy.types.Runner` on real devices.

    params: placed by the caller (one device, or sharded over an instance's mesh); state_sharding:
    a DecodeState-shaped tree of shardings (or one sharding) for the slots' canvas and K/V cache,
    typically K/V split over kv heads on the instance's mesh. Executables are compiled at
    construction for every (step kind, batch bucket, length bucket, block bucket) and cached in
    `compiled` per placement — pass one CompiledSteps to several runners (or to the runner that
    replaces this one after a layout change) to share them.
    """

    def __init__(self, cfg: ModelConfig, graphdef, params, *, num_slots: int, length_buckets: Sequence[int],
                 block_buckets: Sequence[int] = (32,), cache_mode: CacheMode | str = CacheMode.DUAL,
                 tp_degree: int | None = None, state_sharding: Any = None, compiled: CompiledSteps | None = None,
                 warm_up: bool = True, progress: bool = True):
        config = DecoderConfig(num_slots, tuple(length_buckets), tuple(block_buckets), CacheMode(cache_mode))
        self.decoder = SlotDecoder(cfg, graphdef, params, config, state_sharding=state_sharding,
                                   compiled=compiled, warm_up=warm_up, progress=progress)
        self.num_slots = num_slots
        self.tp_degree = tp_degree if tp_degree is not None else len(self.decoder.devices)

    @property
    def compiled(self) -> CompiledSteps:
        return self.decoder.compiled

    @property
    def warm_up_seconds(self) -> float:
        return self.decoder.warm_up_seconds

    def warm_up(self, progress: bool | None = None, label: str = "") -> float:
        """Compile every step shape now (when constructed with warm_up=False); returns seconds."""
        return self.decoder.warm_up(progress, label)

    def admit(self, slot: int, prompt_tokens: Sequence[int], answer_length: int, block_length: int, *,
              temperature: float = 0.0, seed: int = 0, committed: Sequence[int | None] | None = None,
              steps_done: int = 0) -> None:
        self.decoder.admit(slot, prompt_tokens, answer_length, block_length, temperature=temperature, seed=seed,
                           committed=committed, steps_done=steps_done)

    def release(self, slot: int) -> None:
        self.decoder.release(slot)

    def step(self, kind: StepKind, slots: Sequence[int], taus: Sequence[float],
             blocks: Sequence[int] | None = None) -> list[SlotOutcome]:
        return self.decoder.step(StepKind(kind), slots, taus, blocks)

    def reload(self, params) -> None:
        """Swap weights between steps (e.g. after resharding); same tree structure."""
        self.decoder.reload(params)
