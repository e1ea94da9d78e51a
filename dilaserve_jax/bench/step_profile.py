"""Where a decode step's time goes: host overhead versus the compiled computation, and the
compiled computation split by stage.

Two measurements of one step shape on a live SlotDecoder:
- `time_step_parts`: the step as the engine runs it (`SlotDecoder.step`, wall clock) and, inside
  that same step, the executable's call until its results are ready; `outside_ms` = the
  difference, everything the host adds (the slot table, building the arguments, the result copy).
  Measured within one step, it does not move with the machine's load as a difference of two
  separately timed medians did. `compiled_ms` times the executable alone on device-resident inputs,
  `result_copy_ms` the copy of the step's outputs alone.
- `stage_profile`: a JAX profiler trace of the same executable; each XLA operation's time on
  every CPU thread is charged to the `jax.named_scope` stage its HLO carries (decoding/steps.py
  names them) and to its kind (matmul, data movement, elementwise; `op_kind`), nested operations
  counted once (exclusive time). The shares are of thread
  busy time, which on several threads can exceed the wall time; untagged operations are "other".
  Executor bookkeeping and idle waits between operations are not charged to any stage.

The direct executable calls commit tokens the host mirror never sees: time on a throwaway decoder.
"""
from __future__ import annotations

import gzip
import json
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import jax
import numpy as np

from dilaserve_jax.decoding.compiled import put_small
from dilaserve_jax.decoding.decoder import SlotDecoder

try:
    from dilaserve_jax.decoding.steps import STAGES
except ImportError:  # a source tree whose steps name no stages (timed side by side): all "other"
    STAGES = ()

OTHER = "other"
# What an XLA CPU operation does, from the first word of its name (fusions are named after their
# root operations): matrix products, or moving data without arithmetic, or anything else.
OP_KINDS = ("matmul", "data_movement", "elementwise")
_DATA_MOVEMENT = {"gather", "scatter", "wrapped", "copy", "transpose", "concatenate", "slice", "dynamic",
                  "bitcast", "pad", "reverse", "broadcast", "iota"}
_INSTRUCTION = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name="([^"]*)"')
_RESULT_SHAPE = re.compile(r'^\s*(?:ROOT )?%?[\w.\-]+ = (\w+\[[\d,]*\])')


def step_kind(decoder: SlotDecoder, refresh: bool):
    """The decoder's own spelling of a step kind: a StepKind in this tree, a bool in the older trees
    the scaling benchmark also times (read from the decoder's module, never imported here)."""
    kinds = getattr(sys.modules[type(decoder).__module__], "StepKind", None)
    if kinds is None:
        return refresh
    return kinds.REFRESH if refresh else kinds.REUSE


def _executable(decoder: SlotDecoder, refresh: bool, slots: list[int]):
    info = decoder._slots[slots[0]]
    shape = decoder._shape(refresh, slots, info.length, info.block)
    return shape, decoder.compiled.get(shape, decoder.params, decoder.state, decoder._placement)


def _arguments(decoder: SlotDecoder, shape, slots: list[int], taus: list[float], executable):
    """The step's per-row inputs (slot indices, τ and, in trees that take them, block starts), on
    the devices and with the shardings `executable` takes them (replicated, or split by slot shard)."""
    if hasattr(decoder, "step_arguments"):
        *inputs, _ = decoder.step_arguments(shape, slots, taus)
    else:  # a source tree from before step_arguments (timed side by side): slots in order, then padding
        pad = shape.batch - len(slots)
        inputs = [slots + [decoder.num_slots] * pad, taus + [1.0] * pad]
    shardings = executable.input_shardings[0][-len(inputs):]
    dtypes = (np.int32, np.float32, np.int32)
    return tuple(put_small(x, dt, sh) for x, dt, sh in zip(inputs, dtypes, shardings))


def time_step_parts(decoder: SlotDecoder, refresh: bool, slots: list[int], repeats: int = 5) -> dict:
    """Median (and minimum) ms of the engine's step, of the host's part of it, of the compiled
    executable alone and of the result copy.

    Runs 2 * repeats + 1 steps of kind `refresh` over `slots` (τ = 1) on `decoder`, whose slots
    must not finish meanwhile; afterwards its host mirror no longer matches the device state.
    The executable alone gets device-resident arguments and is waited for; the step and the
    compiled call alternate, so both see the same machine load.
    """
    taus = [1.0] * len(slots)
    decoder.step(step_kind(decoder, refresh), slots, taus)  # the first call of a shape may do one-off work
    shape, exe = _executable(decoder, refresh, slots)
    args = _arguments(decoder, shape, slots, taus, exe)
    jax.block_until_ready(args)
    step, outside, compiled, copy = [], [], [], []
    inner: list[float] = []
    get = decoder.compiled.get

    def timed_get(*args, **kwargs):  # the step's own executable, timed until its results are ready
        executable = get(*args, **kwargs)

        def call(*call_args):
            t = time.perf_counter()
            result = executable(*call_args)
            jax.block_until_ready(result)
            inner.append(time.perf_counter() - t)
            return result
        return call

    for _ in range(repeats):
        decoder.compiled.get = timed_get
        try:
            t0 = time.perf_counter()
            decoder.step(step_kind(decoder, refresh), slots, taus)
            step.append(time.perf_counter() - t0)
        finally:
            del decoder.compiled.get  # back to the class's method
        outside.append(step[-1] - inner[-1])
        t0 = time.perf_counter()
        decoder.state, out = exe(decoder.params, decoder.state, *args)
        jax.block_until_ready((decoder.state, out))
        compiled.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        jax.tree.map(np.asarray, out)  # as the decoder copies it (a StepOutput of arrays in older trees)
        copy.append(time.perf_counter() - t0)
    ms = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    # Minima too: on a shared machine the fastest run of each is the one least disturbed by others.
    return {"step_ms": ms(step), "compiled_ms": ms(compiled), "outside_ms": ms(outside),
            "step_min_ms": 1e3 * min(step), "compiled_min_ms": 1e3 * min(compiled),
            "outside_min_ms": 1e3 * min(outside), "result_copy_ms": ms(copy), "shape": shape}


def dense_matmul_rate(rows: int, d_in: int, d_out: int, repeats: int = 5, calls: int = 10) -> float:
    """GFLOP/s of one jitted float32 [rows, d_in] x [d_in, d_out] product on the default device, from
    the fastest of `repeats` timings of `calls` calls in a row: what this machine's matrix units
    give at a step's row count, to read a step's own FLOP rate against."""
    rng = np.random.default_rng(0)
    a = jax.device_put(rng.standard_normal((rows, d_in), dtype=np.float32))
    b = jax.device_put(rng.standard_normal((d_in, d_out), dtype=np.float32))
    product = jax.jit(lambda a, b: a @ b)
    jax.block_until_ready(product(a, b))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = product(a, b)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / calls)
    return 2 * rows * d_in * d_out / best / 1e9


def hlo_op_names(hlo_text: str) -> dict[str, str]:
    """Instruction name -> its op_name metadata (the jax.named_scope path and the primitive)."""
    names = {}
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if m:
            names[m.group(1)] = m.group(2)
    return names


def hlo_result_shapes(hlo_text: str) -> dict[str, str]:
    """Instruction name -> its result type when that is one array (e.g. "f32[32,32,768]")."""
    shapes = {}
    for line in hlo_text.splitlines():
        m, shape = _INSTRUCTION.match(line), _RESULT_SHAPE.match(line)
        if m and shape:
            shapes[m.group(1)] = shape.group(1)
    return shapes


def stages_of(op_names: dict[str, str]) -> dict[str, str]:
    """Instruction name -> the decode stage named in its op_name (innermost wins), else OTHER."""
    return {name: next((p for p in reversed(op.split("/")) if p in STAGES), OTHER) for name, op in op_names.items()}


def hlo_stages(hlo_text: str) -> dict[str, str]:
    """`stages_of` the instructions of an HLO text."""
    return stages_of(hlo_op_names(hlo_text))


def _what(op_name: str) -> str:
    """The last two parts of an op_name past its stage: e.g. "bqkgd,blkd->bkgql/dot_general"."""
    parts = [p for p in op_name.split("/") if p and p not in STAGES and not p.startswith("jit(")]
    return "/".join(parts[-2:]) or op_name


def op_kind(name: str) -> str:
    """OP_KINDS entry of an HLO instruction name (e.g. ynn_fusion.3, transpose_copy_fusion.1)."""
    first = re.split(r"[_.\-]", name, maxsplit=1)[0]
    if first in ("ynn", "dot", "convolution", "onednn", "custom"):
        return "matmul"
    return "data_movement" if first in _DATA_MOVEMENT else "elementwise"


def _exclusive_by_name(trace_events: list[dict]) -> dict[str, float]:
    """Sum of exclusive durations (µs) per event name over every thread (children subtracted)."""
    by_thread = defaultdict(list)
    for e in trace_events:
        if e.get("ph") == "X" and "dur" in e:
            by_thread[(e.get("pid"), e.get("tid"))].append((float(e["ts"]), float(e["dur"]), e["name"]))
    totals: dict[str, float] = defaultdict(float)
    for events in by_thread.values():
        events.sort(key=lambda x: (x[0], -x[1]))
        stack: list[list] = []  # [end, name, exclusive]
        for ts, dur, name in events:
            while stack and stack[-1][0] <= ts:
                done = stack.pop()
                totals[done[1]] += done[2]
            if stack:
                stack[-1][2] -= dur
            stack.append([ts + dur, name, dur])
        for done in stack:
            totals[done[1]] += done[2]
    return totals


def stage_profile(decoder: SlotDecoder, refresh: bool, slots: list[int], repeats: int = 3,
                  top_ops: int = 0) -> dict:
    """Thread-busy ms per step of the compiled executable, from a profiler trace: per stage
    (`busy_ms`) and per OP_KINDS entry (`kind_busy_ms`); plus XLA's cost analysis of the step.
    With `top_ops` > 0 also its `top_ops` largest operations (`top_ops`: name, stage, kind, busy ms
    per step, and what it computes from its op_name), largest first.

    Also runs 1 + repeats steps on `decoder` outside its host mirror (see the module docstring).
    """
    taus = [1.0] * len(slots)
    shape, exe = _executable(decoder, refresh, slots)
    hlo = exe.as_text()
    op_names = hlo_op_names(hlo)
    stages = stages_of(op_names)
    args = _arguments(decoder, shape, slots, taus, exe)
    decoder.state, out = exe(decoder.params, decoder.state, *args)
    jax.block_until_ready(out)
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(repeats):
                decoder.state, out = exe(decoder.params, decoder.state, *args)
                jax.block_until_ready((decoder.state, out))
        trace_file = next(Path(tmp).rglob("perfetto_trace.json.gz"))
        with gzip.open(trace_file) as f:
            data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    per_stage: dict[str, float] = defaultdict(float)
    per_kind: dict[str, float] = defaultdict(float)
    per_op = {name: micros for name, micros in _exclusive_by_name(events).items() if name in stages}
    for name, micros in per_op.items():
        per_stage[stages[name]] += micros
        per_kind[op_kind(name)] += micros
    largest = sorted(per_op, key=per_op.get, reverse=True)[:top_ops]
    busy = {stage: per_stage.get(stage, 0.0) / 1e3 / repeats for stage in (*STAGES, OTHER)}
    kinds = {kind: per_kind.get(kind, 0.0) / 1e3 / repeats for kind in OP_KINDS}
    cost = exe.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    shards = getattr(decoder.config, "slot_shards", 1)  # a slot-sharded step's cost analysis is one shard's
    shapes = hlo_result_shapes(hlo) if largest else {}
    ops = [{"name": name, "stage": stages[name], "kind": op_kind(name), "busy_ms": per_op[name] / 1e3 / repeats,
            "what": f"{_what(op_names[name])} -> {shapes.get(name, '?')}"} for name in largest]
    return {"busy_ms": busy, "kind_busy_ms": kinds, "flops": shards * float(cost.get("flops", 0.0)),
            "bytes_accessed": shards * float(cost.get("bytes accessed", 0.0)), "top_ops": ops}
