"""Attention benchmark: the Pallas flash kernel vs the XLA reference at LLaDA-8B shapes.

`python -m dilaserve_jax.bench.attention [--json] [--attention both|pallas|xla]`
`python -m dilaserve_jax.bench.attention --sharded [--tp 1 2 4 8] [--kv-heads N] [--check]`: the
kernel per shard on TP instances against XLA attention on the same inputs (bench/attention_sharded.py).

On GPU/TPU: time per call, achieved FLOP/s and bytes/s, each against the device peak measured by a
quick probe (a large bf16 matmul and an array copy). On CPU the kernel only runs in interpret mode,
whose timings say nothing about the kernel, so the benchmark reports correctness (max abs error
against the reference) at small shapes instead.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from dilaserve_jax.core.cli import add_config_arguments, config_from_args, opt, returns_exit_status, setup_logging
from dilaserve_jax.kernels import IMPLEMENTATIONS, attention, describe_attention, resolve_attention
from dilaserve_jax.kernels.reference import reference_attention

log = logging.getLogger(__name__)

# LLaDA-8B attention: 32 heads (no GQA), head dim 128.
HEADS, KV_HEADS, HEAD_DIM = 32, 32, 128
CPU_NOTE = ("CPU backend: the Pallas kernel runs in interpret mode, so CPU timings of it mean nothing; "
            "this run checks correctness only (max abs error vs the XLA reference, small shapes).")


@dataclass(frozen=True, slots=True)
class AttentionBenchConfig:
    attention: str = opt("both", "implementation(s) to run (both: kernel and reference side by side)",
                         choices=("both", *IMPLEMENTATIONS))
    batch: tuple[int, ...] | None = opt(None, "batch sizes", default_text="1 4 16; CPU: 1 2")
    canvas: tuple[int, ...] | None = opt(None, "canvas lengths = keys", default_text="1024 2048 4096; CPU: 64 200")
    queries: tuple[str, ...] = opt(("32", "canvas"), "query counts: integers and/or 'canvas' (refresh step)")
    dtype: str = opt("bfloat16", "q/k/v dtype", choices=("bfloat16", "float32"))
    iters: int = opt(10, "timed calls per row (median reported)")
    block_q: int | None = opt(None, "kernel query tile", default_text="per backend")
    block_k: int | None = opt(None, "kernel key tile", default_text="per backend")
    heads: int = opt(HEADS, "query heads (LLaDA-8B's by default)")
    kv_heads: int = opt(KV_HEADS, "kv heads (fewer = GQA)")
    head_dim: int = opt(HEAD_DIM, "head dimension")
    sharded: bool = opt(False, "tensor-parallel case: the kernel per shard (shard_map) on TP instances vs XLA "
                               "attention on the same inputs; per-device shapes, collectives in the compiled program, "
                               "time of both (shapes by default: batch 1 16, canvas 1024 4096; CPU: batch 2, "
                               "canvas 64)")
    tp: tuple[int, ...] | None = opt(None, "--sharded: TP degrees", default_text="1 2 4 8, up to the device count")
    cpu_devices: int = opt(8, "CPU devices to present when the backend is CPU (8 lets --sharded reach TP 8; 0 = leave "
                              "as is)")
    check: bool = opt(False, "exit 1 unless every Pallas row matches XLA (float32 1e-5, bf16 1e-2) with no collective")
    json: bool = opt(False, "print the rows as a JSON array instead of a table")

    def __post_init__(self):
        if self.iters < 1 or min(self.heads, self.kv_heads, self.head_dim) < 1:
            raise ValueError("--iters, --heads, --kv-heads and --head-dim must be positive")
        if any(q != "canvas" and not q.isdigit() for q in self.queries):
            raise ValueError(f"--queries takes integers and 'canvas', got {' '.join(self.queries)}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dilaserve_jax.bench.attention",
        description="Benchmark bidirectional cached attention (Pallas flash kernel vs XLA reference) at "
                    "LLaDA-8B shapes: time, FLOP/s and bytes/s against the device's measured peaks. On CPU it "
                    "reports interpret-mode correctness only.")
    return add_config_arguments(p, AttentionBenchConfig)


def _median_seconds(fn, iters: int) -> float:
    jax.block_until_ready(fn())  # compile and warm up
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_peaks(iters: int = 5) -> dict:
    """Achievable peaks on this device: bf16 matmul FLOP/s and copy bytes/s (read + write)."""
    n = 8192
    a = jnp.ones((n, n), jnp.bfloat16)
    matmul = jax.jit(lambda x: x @ x)
    flops = 2 * n**3 / _median_seconds(lambda: matmul(a), iters)
    x = jnp.ones((256 * 1024 * 1024,), jnp.float32)  # 1 GiB
    copy = jax.jit(lambda y: y + 1.0)
    bandwidth = 2 * x.nbytes / _median_seconds(lambda: copy(x), iters)
    return {"matmul_flops": flops, "copy_bytes_per_s": bandwidth}


def _inputs(args, batch, n_q, n_keys, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (batch, n_q, args.heads, args.head_dim), dtype)
    k = jax.random.normal(keys[1], (batch, n_keys, args.kv_heads, args.head_dim), dtype)
    v = jax.random.normal(keys[2], (batch, n_keys, args.kv_heads, args.head_dim), dtype)
    # Ragged rows as in serving: the last row's canvas is only partly valid.
    valid = jnp.full((batch,), n_keys, jnp.int32).at[-1].set(max(1, (3 * n_keys) // 4))
    return q, k, v, valid


def _cost(q, k, v, valid):
    b, n_q, h, d = q.shape
    keys_seen = int(np.asarray(valid).sum())
    flops = 4 * n_q * h * d * keys_seen  # QK^T and PV, 2 FLOPs per multiply-add
    bytes_moved = q.dtype.itemsize * (2 * q.size + k.size + v.size)  # read q, k, v; write o
    return flops, bytes_moved


def run_rows(args, impls, on_accelerator: bool, peaks: dict | None, kernel_options: dict):
    dtype = jnp.dtype(args.dtype)
    batches = args.batch or ([1, 4, 16] if on_accelerator else [1, 2])
    canvases = args.canvas or ([1024, 2048, 4096] if on_accelerator else [64, 200])
    shapes = [(b, L, L if qs == "canvas" else int(qs)) for L in canvases for qs in args.queries for b in batches]
    rows = []
    for index, (batch, n_keys, n_q) in enumerate(shapes, 1):
        log.info(f"[{index}/{len(shapes)}] batch={batch} canvas={n_keys} queries={n_q}")
        q, k, v, valid = _inputs(args, batch, n_q, n_keys, dtype)
        flops, bytes_moved = _cost(q, k, v, valid)
        try:
            expected = jax.jit(reference_attention)(q, k, v, valid)
        except Exception as err:  # noqa: BLE001 - e.g. the reference's [Q, L] scores do not fit
            expected, ref_error = None, f"{type(err).__name__}: {str(err).splitlines()[0][:80]}"
        for impl in impls:
            row = {"impl": impl, "batch": batch, "canvas": n_keys, "queries": n_q, "heads": args.heads,
                   "head_dim": args.head_dim, "dtype": args.dtype}
            options = kernel_options if impl == "pallas" else {}
            fn = jax.jit(lambda q, k, v, n, impl=impl, options=options: attention(q, k, v, n, impl=impl, **options))
            try:
                out = fn(q, k, v, valid)
                row["max_abs_err"] = None if expected is None else float(
                    jnp.max(jnp.abs(out.astype(jnp.float32) - expected.astype(jnp.float32))))
                row["nan"] = bool(jnp.isnan(out).any())
                if expected is None:
                    row["note"] = f"reference failed ({ref_error})"
                if on_accelerator:
                    seconds = _median_seconds(lambda: fn(q, k, v, valid), args.iters)
                    row.update(ms=seconds * 1e3, tflops=flops / seconds / 1e12, gbps=bytes_moved / seconds / 1e9,
                               pct_peak_flops=100 * flops / seconds / peaks["matmul_flops"],
                               pct_peak_bw=100 * bytes_moved / seconds / peaks["copy_bytes_per_s"])
            except Exception as err:  # noqa: BLE001 - report the failing row and keep going
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
            rows.append(row)
    return rows


SHARDED_COLUMNS = ["impl", "tp", "batch", "canvas", "queries", "heads", "kv_heads", "dtype", "q_per_device",
                   "kv_per_device", "kernel_kv", "collectives", "max_abs_err_vs_xla", "matches_xla", "nan", "ms"]


def format_table(rows, on_accelerator: bool, sharded: bool = False) -> str:
    if sharded:
        cols = list(SHARDED_COLUMNS)
    else:
        cols = ["impl", "batch", "canvas", "queries", "dtype", "max_abs_err", "nan"]
        if on_accelerator:
            cols += ["ms", "tflops", "pct_peak_flops", "gbps", "pct_peak_bw"]
    cols += ["note", "error"]
    cols = [c for c in cols if any(c in r for r in rows)]

    def cell(value):
        if isinstance(value, float):
            return f"{value:.3g}"
        return "" if value is None else str(value)

    table = [cols] + [[cell(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(line, widths)) for line in table)


def _present_cpu_devices(n: int) -> None:
    """Ask for n CPU devices (only the CPU backend reads this). A no-op when XLA_FLAGS already sets a
    count, or once JAX has started (e.g. under pytest): the process keeps the devices it has."""
    if not n or "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass


@returns_exit_status
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = config_from_args(AttentionBenchConfig, parser.parse_args(argv), parser)
    setup_logging(log)
    _present_cpu_devices(args.cpu_devices)
    backend = jax.default_backend()
    on_accelerator = backend != "cpu"
    impls = ["pallas", "xla"] if args.attention == "both" or args.sharded else [resolve_attention(args.attention)]
    kernel_options = {k: v for k, v in (("block_q", args.block_q), ("block_k", args.block_k)) if v}
    device = jax.devices()[0]
    header = {"backend": backend, "device": getattr(device, "device_kind", str(device)), "devices": len(jax.devices()),
              "jax": jax.__version__, "attention": [describe_attention(i) for i in impls]}
    peaks = None
    if args.sharded:
        from dilaserve_jax.bench.attention_sharded import CPU_TIMING_NOTE, check_failures, sharded_rows

        if not on_accelerator:
            header["note"] = CPU_TIMING_NOTE
        rows = sharded_rows(args, on_accelerator)
    else:
        if on_accelerator:
            log.info("measuring device peaks (bf16 matmul, copy bandwidth)...")
            peaks = measure_peaks()
            header.update(peak_tflops=peaks["matmul_flops"] / 1e12, peak_gbps=peaks["copy_bytes_per_s"] / 1e9)
        else:
            header["note"] = CPU_NOTE
        rows = run_rows(args, impls, on_accelerator, peaks, kernel_options)
    if args.json:
        print(json.dumps({**header, "rows": rows}, indent=1))
    else:
        for key, value in header.items():
            print(f"# {key}: {value:.4g}" if isinstance(value, float) else f"# {key}: {value}")
        print(format_table(rows, on_accelerator, sharded=args.sharded))
    if args.sharded and args.check:
        failures = check_failures(rows)
        for failure in failures:
            log.error(f"check failed: {failure}")
        log.info(f"check: {'FAILED' if failures else 'passed'} ({len(rows)} rows)")
        return 1 if failures else 0
    return 1 if any("error" in r or r.get("nan") for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
