"""The sharded case of the attention benchmark (`python -m dilaserve_jax.bench.attention --sharded`).

For each TP degree: one TP-`tp` instance from `Layout.build`, q/k/v laid out on it by the sharding
table, then the Pallas kernel per shard (`kernels.sharded.sharded_flash_attention`, the shard_map
path, at every TP including 1) and XLA attention on the same placed inputs. Each row reports the
per-device shapes, the collectives in the compiled program (there should be none: every device
computes its own heads), the largest difference from XLA attention at full float32 precision, and
the median time of both, timed call by call in turn in the same run. With `--check` a mismatch
beyond the test tolerances, a collective in a Pallas program, NaN, an error or a kernel that could
not be compared fails the run.

On CPU the kernel runs in interpret mode: its time is a smoke check that the program runs, not a
measurement of the kernel, and the report says so.
"""
from __future__ import annotations

import functools
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dilaserve_jax.kernels import attention
from dilaserve_jax.kernels.sharded import kernel_kv_heads, sharded_flash_attention

TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}  # as tests/kernels (atol = rtol)
COLLECTIVE = re.compile(r"\s(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(")
CPU_TIMING_NOTE = ("CPU backend: the Pallas kernel runs in interpret mode, so its ms column is only a smoke "
                   "check that the sharded program runs; it says nothing about kernel speed.")


def collectives(compiled_text: str) -> str:
    """'none' or e.g. 'all-gather x3' for the collectives in compiled HLO text."""
    found = COLLECTIVE.findall(compiled_text)
    return ", ".join(f"{name} x{found.count(name)}" for name in sorted(set(found))) or "none"


def _shape(x) -> str:
    return "x".join(map(str, x))


def _placed_inputs(instance, batch, n_q, n_keys, heads, kv_heads, head_dim, dtype, seed=0):
    from dilaserve_jax.kernels.partition import attention_partition_specs

    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (batch, n_q, heads, head_dim), dtype)
    k = jax.random.normal(keys[1], (batch, n_keys, kv_heads, head_dim), dtype)
    v = jax.random.normal(keys[2], (batch, n_keys, kv_heads, head_dim), dtype)
    valid = jnp.full((batch,), n_keys, jnp.int32).at[-1].set(max(1, (3 * n_keys) // 4))  # one ragged row
    heads_spec, kv_spec = attention_partition_specs(heads, kv_heads, instance.tp)
    specs = (heads_spec, kv_spec, kv_spec, P())
    return [jax.device_put(x, NamedSharding(instance.mesh, s)) for x, s in zip((q, k, v, valid), specs)], kv_spec


def _full_precision_reference(placed):
    """XLA attention with float32 matmuls at full precision (GPUs may otherwise use TF32): what the
    kernel is compared with. The timed xla row is the model's attention at default precision."""
    with jax.default_matmul_precision("highest"):
        return jax.jit(lambda q, k, v, n: attention(q, k, v, n, impl="xla"))(*placed)


def interleaved_medians(fns: dict, iters: int) -> dict:
    """Median seconds per call of each fn, timed in turn within every round so drift hits all alike."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    times = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _error(err: Exception) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"


def sharded_rows(args, on_accelerator: bool) -> list[dict]:
    n_devices = len(jax.devices())
    tps = args.tp or [tp for tp in (1, 2, 4, 8) if tp <= n_devices]
    batches = args.batch or ([1, 4] if on_accelerator else [2])
    canvases = args.canvas or ([1024, 4096] if on_accelerator else [64])
    shapes = [(tp, b, L, L if qs == "canvas" else int(qs)) for tp in tps for L in canvases for qs in args.queries
              for b in batches]
    rows = []
    for index, (tp, batch, n_keys, n_q) in enumerate(shapes, 1):
        print(f"[{index}/{len(shapes)}] tp={tp} batch={batch} canvas={n_keys} queries={n_q}", file=sys.stderr,
              flush=True)
        base = {"tp": tp, "batch": batch, "canvas": n_keys, "queries": n_q, "heads": args.heads,
                "kv_heads": args.kv_heads, "dtype": args.dtype}
        if tp > n_devices:
            rows.append({**base, "impl": "pallas", "note": f"skipped: TP {tp} needs {tp} devices, {n_devices} here"})
            continue
        rows.extend(_shape_rows(args, base, iters=args.iters if on_accelerator else min(args.iters, 3)))
    return rows


def _shape_rows(args, base: dict, iters: int) -> list[dict]:
    """The pallas and xla rows of one (tp, batch, canvas, queries)."""
    from dilaserve_jax.mesh import Layout

    tp, batch, n_keys, n_q = base["tp"], base["batch"], base["canvas"], base["queries"]
    try:
        instance = Layout.build(str(tp), allow_unused=True).instances[0]
        placed, kv_spec = _placed_inputs(instance, batch, n_q, n_keys, args.heads, args.kv_heads, args.head_dim,
                                         jnp.dtype(args.dtype))
    except Exception as err:  # noqa: BLE001 - e.g. TP does not divide the heads: report it and go on
        return [{**base, "impl": "pallas", "error": _error(err)}]
    q, k = placed[0], placed[1]
    base = {**base, "q_per_device": _shape(q.addressable_shards[0].data.shape),
            "kv_per_device": _shape(k.addressable_shards[0].data.shape)}
    kernel_options = {k: v for k, v in (("block_q", args.block_q), ("block_k", args.block_k)) if v}
    fns = {"pallas": lambda q, k, v, n: sharded_flash_attention(q, k, v, n, mesh=instance.mesh, **kernel_options),
           "xla": lambda q, k, v, n: attention(q, k, v, n, impl="xla")}
    rows, compiled, outputs = {}, {}, {}
    for impl, fn in fns.items():
        rows[impl] = {**base, "impl": impl}
        try:
            compiled[impl] = jax.jit(fn).lower(*placed).compile()
            rows[impl]["collectives"] = collectives(compiled[impl].as_text())
            outputs[impl] = compiled[impl](*placed)
            rows[impl]["nan"] = bool(jnp.isnan(outputs[impl]).any())
        except Exception as err:  # noqa: BLE001 - report the failing row and keep going
            rows[impl]["error"] = _error(err)
    # The K/V the kernel reads per device (one kv head's slice when the table replicates K/V).
    kv_heads = kernel_kv_heads(args.heads, args.kv_heads, tp, kv_replicated=tp > 1 and kv_spec == P())
    rows["pallas"]["kernel_kv"] = _shape((batch, n_keys, kv_heads, args.head_dim))
    if outputs:
        try:
            want = np.asarray(_full_precision_reference(placed), np.float32)
        except Exception as err:  # noqa: BLE001 - e.g. the [Q, L] scores do not fit
            rows["pallas"]["note"] = f"reference failed ({_error(err)})"
            want = None
        tol = TOLERANCE[args.dtype]
        for impl, out in outputs.items() if want is not None else ():
            got = np.asarray(out, np.float32)
            rows[impl]["max_abs_err_vs_xla"] = float(np.max(np.abs(got - want)))
            if impl == "pallas":
                rows[impl]["matches_xla"] = bool(np.allclose(got, want, atol=tol, rtol=tol))
    if outputs:
        medians = interleaved_medians({i: functools.partial(compiled[i], *placed) for i in outputs}, iters)
        for impl, seconds in medians.items():
            rows[impl]["ms"] = seconds * 1e3
    return list(rows.values())


def check_failures(rows: list[dict]) -> list[str]:
    """Why a --check run fails (empty when it passes)."""
    failures = []
    for r in rows:
        where = f"{r['impl']} tp={r['tp']} batch={r['batch']} canvas={r['canvas']} queries={r['queries']}"
        if "error" in r:
            failures.append(f"{where}: {r['error']}")
        if r.get("nan"):
            failures.append(f"{where}: NaN in the output")
        skipped = r.get("note", "").startswith("skipped")
        if r["impl"] == "pallas" and "error" not in r and not skipped and "matches_xla" not in r:
            failures.append(f"{where}: not compared with XLA ({r.get('note', 'no reference')})")
        if r["impl"] == "pallas" and r.get("matches_xla") is False:
            failures.append(f"{where}: differs from XLA by {r['max_abs_err_vs_xla']:.3g}")
        if r["impl"] == "pallas" and r.get("collectives", "none") != "none":
            failures.append(f"{where}: collectives in the kernel's program: {r['collectives']}")
    return failures
