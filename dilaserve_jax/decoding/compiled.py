"""Ahead-of-time compiled steps, cached per (step shape, placement).

A placement is the device set and shardings of the params and the state; an instance layout seen
before reuses its executables, so serving never compiles after start-up. `compile_count` counts
every executable this cache has built (the no-recompile test reads it).
"""
from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from dilaserve_jax.decoding.buckets import StepShape
from dilaserve_jax.decoding.slot_shards import SLOTS_AXIS, shards_of
from dilaserve_jax.decoding.state import DecodeState
from dilaserve_jax.decoding.steps import admit_slot, decode_step
from dilaserve_jax.models.config import ModelConfig

ADMIT = "admit"  # key of the admission executable (one per placement)


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def replicated_on(sharding) -> Any:
    """A sharding that replicates small inputs (slot indices, τ) over the devices of `sharding`."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec())
    return SingleDeviceSharding(min(sharding.device_set, key=lambda d: d.id))


def leaf_placement(tree) -> tuple:
    """Hashable identity of where a tree's leaves live. Take a state's from it as placed at start:
    step outputs may carry an equivalent sharding spelled differently (trailing None dropped)."""
    return tuple((x.shape, str(x.dtype), x.sharding) for x in jax.tree.leaves(tree))


@dataclass
class CompiledSteps:
    """Compiles decode steps AOT on demand or in bulk (`warm_up`) and keeps them by key."""

    cfg: ModelConfig
    graphdef: Any
    executables: dict[tuple, Any] = field(default_factory=dict)
    compile_seconds: float = 0.0
    compile_count: int = 0
    # instances share one cache and warm up on their own engine threads: one build at a time
    # (lookups of built executables take no lock)
    _build_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def _constrain(self, state_like: DecodeState) -> Callable:
        """Keep a sharded state's output layout equal to its input layout (it is fed back each step)."""
        shardings = jax.tree.map(lambda x: x.sharding, state_like)
        if all(isinstance(s, SingleDeviceSharding) for s in jax.tree.leaves(shardings)):
            return lambda s: s
        return lambda s: jax.lax.with_sharding_constraint(s, shardings)

    def _build(self, key: tuple, params, state: DecodeState):
        shape = key[0]
        small = replicated_on(state.canvas.sharding)
        constrain = self._constrain(state)
        t0 = time.perf_counter()
        if shape == ADMIT:
            def fn(st, *args):
                return constrain(admit_slot(st, *args))

            row = jax.ShapeDtypeStruct((state.length,), jnp.int32, sharding=small)
            scalars = [jax.ShapeDtypeStruct((), dt, sharding=small)  # slot, prompt, answer, block start,
                       for dt in (jnp.int32, jnp.int32, jnp.int32, jnp.int32,  # block length, temperature,
                                  jnp.int32, jnp.float32, jnp.uint32, jnp.int32)]  # seed, steps
            slot, *rest = scalars
            lowered = jax.jit(fn, donate_argnums=0).lower(_abstract(state), slot, row, *rest)
        else:
            fn, rows = self._step_fn(shape, state, constrain)
            batch_in = jax.ShapeDtypeStruct((shape.batch,), jnp.int32, sharding=rows)
            taus_in = jax.ShapeDtypeStruct((shape.batch,), jnp.float32, sharding=rows)
            blocks_in = jax.ShapeDtypeStruct((shape.batch,), jnp.int32, sharding=rows)
            lowered = jax.jit(fn, donate_argnums=1).lower(_abstract(params), _abstract(state), batch_in, taus_in,
                                                          blocks_in)
        executable = lowered.compile()
        self.compile_seconds += time.perf_counter() - t0
        self.compile_count += 1
        self.executables[key] = executable
        return executable

    def _step_fn(self, shape: StepShape, state: DecodeState, constrain: Callable) -> tuple[Callable, Any]:
        """(the step of `shape` on a state placed like `state`, the sharding of its per-row inputs).
        A slot-sharded state steps every shard on its own part of the batch (decoding/slot_shards.py)."""
        shards = shards_of(state.canvas.sharding)
        if shards == 1:
            step_fn = partial(decode_step, self.graphdef, shape=shape, cfg=self.cfg)

            def fn(p, st, slots, taus, blocks):
                new_state, out = step_fn(p, st, slots, taus, blocks)
                return constrain(new_state), out
            return fn, replicated_on(state.canvas.sharding)
        part = replace(shape, batch=shape.batch // shards)
        split = PartitionSpec(SLOTS_AXIS)
        fn = jax.shard_map(partial(decode_step, self.graphdef, shape=part, cfg=self.cfg),
                           mesh=state.canvas.sharding.mesh, in_specs=(PartitionSpec(), split, split, split, split),
                           out_specs=(split, split), check_vma=False)
        return fn, state.canvas.sharding

    def get(self, shape: StepShape | str, params, state: DecodeState, placement: tuple):
        key = (shape, placement)
        executable = self.executables.get(key)
        if executable is not None:
            return executable
        with self._build_lock:
            executable = self.executables.get(key)
            return executable if executable is not None else self._build(key, params, state)

    def warm_up(self, shapes: Iterable[StepShape], params, state: DecodeState, placement: tuple,
                progress: bool = True, label: str = "") -> float:
        """Compile every shape (plus admission) for this placement; returns the seconds it took.
        `label` (e.g. the instance's name) prefixes the progress bar."""
        from tqdm.auto import tqdm

        todo = [s for s in [ADMIT, *shapes] if (s, placement) not in self.executables]
        t0 = time.perf_counter()
        desc = f"{label}: compiling decode steps" if label else "compiling decode steps"
        bar = tqdm(todo, desc=desc, unit="exe", file=sys.stderr, disable=not progress or not todo)
        for shape in bar:
            bar.set_postfix_str(shape if isinstance(shape, str) else
                                f"{shape.step.value} b{shape.batch} L{shape.length} blk{shape.block} q{shape.queries}")
            self.get(shape, params, state, placement)
        bar.close()
        seconds = time.perf_counter() - t0
        if progress and todo:
            print(f"{label + ': ' if label else ''}compiled {len(todo)} decode-step executables in {seconds:.1f} s",
                  file=sys.stderr)
        return seconds


def put_small(values, dtype, sharding) -> jax.Array:
    """Host values -> a device array on the state's devices (what the executables expect)."""
    return jax.device_put(np.asarray(values, dtype=dtype), sharding)


def enable_compile_cache(directory: str | None) -> None:
    """Keep compiled executables on disk under `directory` ("none" or None: off), so restarts skip
    recompiling; every executable is kept, however quickly it compiled."""
    if directory in (None, "none"):
        return
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
