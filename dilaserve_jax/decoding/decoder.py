"""SlotDecoder: the host side of fast decoding — slot table, bucketing, dispatch to compiled steps.

It owns one DecodeState whose canvas length is the largest length bucket. Each admitted request
gets the smallest length bucket that holds prompt + answer and the smallest block bucket that holds
its block length; a step runs over canvas positions [0, length bucket) only. A batch whose slots
have different buckets runs as one executable per bucket pair (a request's numerics thus never
depend on what shares its batch); with one length and block bucket that is always one executable.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import numpy as np

from dilaserve_jax.core.buckets import bucket_for, powers_of_two_up_to, slot_buckets
from dilaserve_jax.core.kinds import CacheMode, StepKind
from dilaserve_jax.core.outcome import SlotOutcome
from dilaserve_jax.decoding.buckets import StepShape, StepType, prefix_query_buckets, shapes_for
from dilaserve_jax.decoding.compiled import ADMIT, CompiledSteps, leaf_placement, put_small, replicated_on
from dilaserve_jax.decoding.shift import dual_queries
from dilaserve_jax.decoding.slot_shards import (default_slot_devices, per_shard_counts, replicated, shard_rows,
                                                shards_of, slot_mesh, slot_sharding)
from dilaserve_jax.decoding.state import DecodeState, init_state
from dilaserve_jax.decoding.steps import runs_in_place
from dilaserve_jax.models.config import ModelConfig
from dilaserve_jax.models.memory import slots_for_budget


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    """Slots, buckets and cache mode of one decoder (one serving instance)."""

    num_slots: int
    length_buckets: tuple[int, ...]
    block_buckets: tuple[int, ...] = (32,)
    cache_mode: CacheMode = CacheMode.DUAL
    # Devices the slots are split over (decoding/slot_shards.py); 1 = the state on one placement.
    slot_shards: int = 1

    def __post_init__(self):
        object.__setattr__(self, "cache_mode", CacheMode(self.cache_mode))
        object.__setattr__(self, "length_buckets", tuple(sorted(set(self.length_buckets))))
        object.__setattr__(self, "block_buckets", tuple(sorted(set(self.block_buckets))))
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be positive, got {self.num_slots}")
        if self.slot_shards < 1 or self.num_slots % self.slot_shards:
            raise ValueError(f"slot_shards must be positive and divide num_slots ({self.num_slots}), "
                             f"got {self.slot_shards}")
        if not self.length_buckets or min(self.length_buckets) < 1:
            raise ValueError(f"length_buckets must be positive and non-empty, got {self.length_buckets}")
        if not self.block_buckets or min(self.block_buckets) < 1:
            raise ValueError(f"block_buckets must be positive and non-empty, got {self.block_buckets}")
        if self.block_buckets[0] > self.length_buckets[-1]:
            raise ValueError("the smallest block bucket exceeds every length bucket")

    @classmethod
    def from_budget(cls, model: ModelConfig, budget_bytes: int, length_buckets: Sequence[int],
                    block_buckets: Sequence[int] = (32,), cache_mode: CacheMode | str = CacheMode.DUAL,
                    max_slots: int | None = None) -> "DecoderConfig":
        """As many slots of the largest length bucket as `budget_bytes` of device memory holds."""
        mode = CacheMode(cache_mode)
        n = slots_for_budget(model, max(length_buckets), budget_bytes, with_cache=mode is not CacheMode.NONE)
        if n < 1:
            raise ValueError(f"{budget_bytes} bytes hold no slot of length {max(length_buckets)}")
        return cls(min(n, max_slots) if max_slots else n, tuple(length_buckets), tuple(block_buckets), mode)

    @property
    def shard_batch_buckets(self) -> tuple[int, ...]:
        """Batch buckets of one slot shard's part of a step."""
        return powers_of_two_up_to(self.num_slots // self.slot_shards)

    @property
    def batch_buckets(self) -> tuple[int, ...]:
        """A step's whole batch: every shard's part is the same per-shard bucket."""
        return tuple(self.slot_shards * b for b in self.shard_batch_buckets)

    @property
    def max_length(self) -> int:
        return self.length_buckets[-1]

    def step_shapes(self, shift: int = 0) -> list[StepShape]:
        """shift: the model's logits shift (decoding/shift.py), which sets dual reuse steps' query rows."""
        return shapes_for(self.cache_mode, self.batch_buckets, self.length_buckets, self.block_buckets, shift)


@dataclass
class _Slot:
    prompt_len: int
    answer_len: int
    block_len: int
    length: int  # length bucket
    block: int  # block bucket
    block_start: int
    needs_refresh: bool
    finished: bool
    canvas: np.ndarray  # host mirror of [0, prompt_len + answer_len)


class SlotDecoder:
    """Batched fast decoding over a fixed set of slots; see the module docstring.

    params and state placement are the caller's: pass params already placed (replicated or sharded
    over an instance's mesh) and `state_sharding` (a DecodeState-shaped tree or one sharding) for
    the state; the compiled steps follow the inputs' placement and are cached per placement.
    """

    def __init__(self, cfg: ModelConfig, graphdef, params, config: DecoderConfig, *, state_sharding: Any = None,
                 compiled: CompiledSteps | None = None, warm_up: bool = True, progress: bool = True):
        if config.max_length > cfg.max_len:
            raise ValueError(f"length bucket {config.max_length} exceeds the model's max_len {cfg.max_len}")
        if config.slot_shards > 1 and state_sharding is None:  # the first slot_shards local devices
            mesh = slot_mesh(default_slot_devices(config.slot_shards))
            state_sharding, params = slot_sharding(mesh), jax.device_put(params, replicated(mesh))
        self.cfg, self.graphdef, self.params, self.config = cfg, graphdef, params, config
        self.state: DecodeState = init_state(cfg, config.num_slots, config.max_length,
                                             with_cache=config.cache_mode is not CacheMode.NONE,
                                             sharding=state_sharding)
        shards = shards_of(self.state.canvas.sharding)
        if shards != config.slot_shards:
            raise ValueError(f"the state sharding splits the slots {shards} ways, the config {config.slot_shards}")
        if shards > 1 and not all(x.sharding.is_fully_replicated for x in jax.tree.leaves(params)):
            raise ValueError("slot shards step with a full copy of the weights on every shard: replicate params "
                             "over the state's mesh")
        self.compiled = compiled if compiled is not None else CompiledSteps(cfg, graphdef)
        self._small = replicated_on(self.state.canvas.sharding)
        self._state_placement = leaf_placement(self.state)  # as placed; outputs keep an equivalent layout
        self._placement = leaf_placement(params) + self._state_placement
        self._progress, self._eager_compile = progress, warm_up
        self._slots: dict[int, _Slot] = {}
        self.warm_up_seconds = self.compiled.warm_up(self.step_shapes(), params, self.state, self._placement,
                                                     progress) if warm_up else 0.0

    def warm_up(self, progress: bool | None = None, label: str = "") -> float:
        """Compile (or fetch) every step shape for the current placement now; returns seconds.
        For callers that construct with warm_up=False to do this later (e.g. after a server is up);
        `label` names the progress bar (e.g. the instance)."""
        self._eager_compile = True
        self.warm_up_seconds = self.compiled.warm_up(self.step_shapes(), self.params, self.state,
                                                     self._placement, self._progress if progress is None else progress,
                                                     label)
        return self.warm_up_seconds

    def step_shapes(self) -> list[StepShape]:
        """Every step shape this decoder can run (its model's logits shift included)."""
        return self.config.step_shapes(self.cfg.logits_shift)

    @property
    def num_slots(self) -> int:
        return self.config.num_slots

    @property
    def devices(self) -> frozenset:
        return frozenset(self.state.canvas.sharding.device_set)

    def reload(self, params) -> None:
        """Swap weights between steps (same structure). Weights placed as before reuse every
        executable; a new placement compiles all step shapes now, not at the next step. Every
        slot's cached K/V came from the old weights, so each slot's next step must refresh."""
        if jax.tree.structure(params) != jax.tree.structure(self.params):
            raise ValueError("reload: params have a different structure from the current ones")
        self.params = params
        for info in self._slots.values():
            info.needs_refresh = True
        placement = leaf_placement(params) + self._state_placement
        if placement != self._placement:
            self._placement = placement
            if self._eager_compile:
                self.compiled.warm_up(self.step_shapes(), params, self.state, placement, self._progress)

    def admit(self, slot: int, prompt_tokens: Sequence[int], answer_length: int, block_length: int, *,
              temperature: float = 0.0, seed: int = 0, committed: Sequence[int | None] | None = None,
              steps_done: int = 0) -> None:
        """Place a canvas in `slot` (which must be free); its next step must be a refresh.

        A request resuming here (moved from another instance) passes `committed`, its answer tokens
        by position (None = masked), and `steps_done` (sampling keys continue from there); its
        current block is the first one with a masked position."""
        self._check_slot(slot)
        if slot in self._slots:
            raise ValueError(f"slot {slot} is occupied; release it first")
        prompt = [int(t) for t in prompt_tokens]
        if not prompt or answer_length < 1 or block_length < 1:
            raise ValueError("need a non-empty prompt and positive answer and block lengths")
        if any(not 0 <= t < self.cfg.vocab_size or t == self.cfg.mask_id for t in prompt):
            raise ValueError("prompt tokens must be in the vocabulary and must not be the mask token")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        total = len(prompt) + answer_length
        length, block = slot_buckets(len(prompt), answer_length, block_length, self.config.length_buckets,
                                     self.config.block_buckets)
        if block > length:
            raise ValueError(f"block bucket {block} is longer than the canvas bucket {length}")
        row = np.full((self.config.max_length,), self.cfg.pad_id, np.int32)
        row[:len(prompt)] = prompt
        row[len(prompt):total] = self.cfg.mask_id
        block_start = len(prompt) + self._resume(row[len(prompt):total], committed, block_length)
        if steps_done < 0:
            raise ValueError(f"steps_done must be >= 0, got {steps_done}")
        exe = self.compiled.get(ADMIT, self.params, self.state, self._placement)
        args = [put_small(v, dt, self._small) for v, dt in (
            (slot, np.int32), (row, np.int32), (len(prompt), np.int32), (answer_length, np.int32),
            (block_start, np.int32), (block_length, np.int32), (temperature, np.float32), (seed % 2**32, np.uint32),
            (steps_done, np.int32))]
        self.state = exe(self.state, *args)
        self._slots[slot] = _Slot(len(prompt), answer_length, block_length, length, block, block_start,
                                  needs_refresh=True, finished=False, canvas=row[:total].copy())

    def _resume(self, answer: np.ndarray, committed: Sequence[int | None] | None, block_length: int) -> int:
        """Write a resuming request's committed tokens into its answer area (in place); returns the
        answer-relative start of its current block (0 for a fresh request)."""
        if committed is None:
            return 0
        if len(committed) != answer.size:
            raise ValueError(f"committed has {len(committed)} positions, the answer area {answer.size}")
        tokens = [t for t in committed if t is not None]
        if any(not 0 <= int(t) < self.cfg.vocab_size or int(t) == self.cfg.mask_id for t in tokens):
            raise ValueError("committed tokens must be in the vocabulary and must not be the mask token")
        masked = [i for i, t in enumerate(committed) if t is None]
        if not masked:
            raise ValueError("a resuming request needs at least one masked position (it would be finished)")
        start = masked[0] // block_length * block_length
        if any(t is not None for t in committed[start + block_length:]):
            raise ValueError("committed tokens lie beyond the current block")
        for i, t in enumerate(committed):
            if t is not None:
                answer[i] = int(t)
        return start

    def release(self, slot: int) -> None:
        """Forget the slot's request (its device rows are overwritten by the next admission)."""
        self._check_slot(slot)
        self._slots.pop(slot, None)

    def is_free(self, slot: int) -> bool:
        return slot not in self._slots

    def needs_refresh(self, slot: int) -> bool:
        return self._info(slot).needs_refresh

    def canvas(self, slot: int) -> list[int]:
        """Prompt + answer area of the slot as it stands (mask id at undecided positions)."""
        return self._info(slot).canvas.tolist()

    def answer(self, slot: int) -> list[int]:
        """Committed answer tokens up to (excluding) the first EOS."""
        return list(self._answer(self._info(slot)))

    def _answer(self, info: _Slot) -> tuple[int, ...]:
        ans = info.canvas[info.prompt_len:]
        eos = np.flatnonzero(ans == self.cfg.eos_id)
        return tuple(int(t) for t in ans[:int(eos[0]) if eos.size else ans.size])

    def step(self, kind: StepKind, slots: Sequence[int], taus: Sequence[float],
             blocks: Sequence[int] | None = None) -> list[SlotOutcome]:
        """One batched step of `kind` over `slots` with thresholds `taus`; outcomes in slot order
        (a finishing slot's carries its answer).

        blocks: each slot's current block (answer-relative block index) as a scheduler's plan says
        it; the plan then owns the block and the step kind, and the decoder follows them. Without
        it (offline decoding, where no scheduler exists) the decoder works both out itself: a slot
        starts at the block its admission gave it and moves on when a step finishes the block, and
        a reuse step of a slot that needs a refresh (just admitted or reloaded, or its previous
        block just finished) is an error. A refresh is allowed at any step (it only makes the
        cache exact again). In cache mode none both kinds are a full forward.
        """
        if not isinstance(kind, StepKind):  # a bool would read as an IntEnum value: REUSE for True
            raise TypeError(f"step kind must be a StepKind, got {kind!r}")
        refresh = kind is StepKind.REFRESH
        slots, taus = [int(s) for s in slots], [float(t) for t in taus]
        if len(slots) != len(taus) or not slots:
            raise ValueError("need one τ per slot and at least one slot")
        if blocks is not None:
            self._follow_plan(slots, [int(b) for b in blocks])
        if len(set(slots)) != len(slots):
            raise ValueError(f"duplicate slots in a step: {slots}")
        for slot, tau in zip(slots, taus):
            info = self._info(slot)
            if not 0.0 < tau <= 1.0:
                raise ValueError(f"τ must be in (0, 1], got {tau}")
            if info.finished:
                raise ValueError(f"slot {slot} has finished; release it")
            if blocks is None and not refresh and info.needs_refresh and self.config.cache_mode is not CacheMode.NONE:
                raise ValueError(f"slot {slot} needs a refresh step (new request or new block)")
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i, slot in enumerate(slots):
            groups[(self._slots[slot].length, self._slots[slot].block)].append(i)
        results: list[SlotOutcome | None] = [None] * len(slots)
        for (length, block), idx in groups.items():
            shape = self._shape(refresh, [slots[i] for i in idx], length, block)
            for i, res in zip(idx, self._run(shape, [slots[i] for i in idx], [taus[i] for i in idx])):
                results[i] = res
        return results  # type: ignore[return-value]

    def _follow_plan(self, slots: list[int], blocks: list[int]) -> None:
        """Take each slot's current block from the caller's plan."""
        if len(blocks) != len(slots):
            raise ValueError(f"{len(blocks)} blocks for {len(slots)} slots")
        for slot, b in zip(slots, blocks):
            info = self._info(slot)
            if not 0 <= b * info.block_len < info.answer_len:
                raise ValueError(f"slot {slot}: block {b} is outside its answer of {info.answer_len} "
                                 f"(blocks of {info.block_len})")
            info.block_start = info.prompt_len + b * info.block_len

    def _shape(self, refresh: bool, slots: list[int], length: int, block: int) -> StepShape:
        shards = self.config.slot_shards  # every shard's part of the batch has the fullest shard's bucket
        part = max(per_shard_counts(slots, self.num_slots, shards)) if shards > 1 else len(slots)
        batch = shards * bucket_for(part, self.config.shard_batch_buckets)
        mode = self.config.cache_mode
        if mode is CacheMode.NONE:
            return StepShape(StepType.FULL, batch, length, block, length)
        if refresh:
            return StepShape(StepType.REFRESH, batch, length, block, length)
        shift = self.cfg.logits_shift
        if mode is CacheMode.DUAL:
            return StepShape(StepType.DUAL, batch, length, block, dual_queries(block, length, shift))
        queries = max(self._slots[s].prompt_len + self._slots[s].answer_len - self._slots[s].block_start
                      for s in slots) + shift  # block + suffix, and the row before the block when shifted
        return StepShape(StepType.PREFIX, batch, length, block, bucket_for(queries, prefix_query_buckets(length, block)))

    def step_arguments(self, shape: StepShape, slots: list[int], taus: list[float]) -> tuple:
        """(slot indices [B], τ [B], block starts [B], batch row of each of `slots`) for a step of
        `shape`: the slots in order then padding (index S, τ 1, block start -1) — or, for a step
        that runs on the state where it lies (decoding/steps.py `runs_in_place`), row r = slot r,
        index S where slot r is not stepped. With slot shards, the same per shard: part d of the
        batch, indices local to shard d (decoding/slot_shards.py)."""
        in_place = runs_in_place(shape, self.num_slots, self.config.max_length)
        shards = self.config.slot_shards
        index, tau, rows = shard_rows(slots, taus, self.num_slots, shards, shape.batch // shards, in_place)
        starts = np.full(index.shape, -1, np.int32)
        starts[rows] = [self._slots[s].block_start for s in slots]
        return index, tau, starts, rows

    def _run(self, shape: StepShape, slots: list[int], taus: list[float]) -> list[SlotOutcome]:
        exe = self.compiled.get(shape, self.params, self.state, self._placement)
        index, tau, starts, rows = self.step_arguments(shape, slots, taus)
        # Host arrays go to the executable as they are: its own argument transfer (to the input
        # sharding it was compiled for) costs a fraction of a separate device_put per argument.
        self.state, out = exe(self.params, self.state, index, tau, starts)
        # np.asarray per field, not jax.device_get: half the host time of a batch-1 step (docs/decode_throughput.md)
        out = type(out)(*(np.asarray(field) for field in out))
        results = []
        for row, slot in zip(rows, slots):
            info = self._slots[slot]
            n = int(out.n_committed[row])
            pos, tok = out.positions[row, :n], out.tokens[row, :n]
            info.canvas[pos] = tok
            block_done, finished = bool(out.block_finished[row]), bool(out.request_finished[row])
            if block_done:
                info.block_start += info.block_len
            info.needs_refresh = block_done
            info.finished = finished
            results.append(SlotOutcome(slot, tuple(int(p) - info.prompt_len for p in pos), tuple(int(t) for t in tok),
                                       n, float(out.max_confidence[row]), block_done, finished,
                                       tuple(int(c) for c in out.confidence_counts[row]),
                                       self._answer(info) if finished else None))
        return results

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is outside [0, {self.num_slots})")

    def _info(self, slot: int) -> _Slot:
        self._check_slot(slot)
        try:
            return self._slots[slot]
        except KeyError:
            raise ValueError(f"slot {slot} holds no request") from None
