"""Attention benchmark: the Pallas flash kernel vs the XLA reference at LLaDA-8B shapes.

`python -m dilaserve_jax.bench.attention [--json] [--attention both|pallas|xla]`

On GPU/TPU: time per call, achieved FLOP/s and bytes/s, each against the device peak measured by a
quick probe (a large bf16 matmul and an array copy). On CPU the kernel only runs in interpret mode,
whose timings say nothing about the kernel, so the benchmark reports correctness (max abs error
against the reference) at small shapes instead.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from dilaserve_jax.kernels import attention, describe_attention, resolve_attention
from dilaserve_jax.kernels.reference import reference_attention

# LLaDA-8B attention: 32 heads (no GQA), head dim 128.
HEADS, KV_HEADS, HEAD_DIM = 32, 32, 128
CPU_NOTE = ("CPU backend: the Pallas kernel runs in interpret mode, so CPU timings of it mean nothing; "
            "this run checks correctness only (max abs error vs the XLA reference, small shapes).")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dilaserve_jax.bench.attention",
        description="Benchmark bidirectional cached attention (Pallas flash kernel vs XLA reference) at "
                    "LLaDA-8B shapes: time, FLOP/s and bytes/s against the device's measured peaks. On CPU it "
                    "reports interpret-mode correctness only.")
    p.add_argument("--attention", default="both", choices=("both", "auto", "xla", "pallas"),
                   help="implementation(s) to run (default both: kernel and reference side by side)")
    p.add_argument("--batch", type=int, nargs="+", default=None, help="batch sizes (default 1 4 16; CPU: 1 2)")
    p.add_argument("--canvas", type=int, nargs="+", default=None,
                   help="canvas lengths = keys (default 1024 2048 4096; CPU: 64 200)")
    p.add_argument("--queries", nargs="+", default=["32", "canvas"],
                   help="query counts: integers and/or 'canvas' (refresh step) (default 32 canvas)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="q/k/v dtype")
    p.add_argument("--iters", type=int, default=10, help="timed calls per row (median reported)")
    p.add_argument("--block-q", type=int, default=None, help="kernel query tile (default per backend)")
    p.add_argument("--block-k", type=int, default=None, help="kernel key tile (default per backend)")
    p.add_argument("--json", action="store_true", help="print the rows as a JSON array instead of a table")
    return p


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


def _inputs(batch, n_q, n_keys, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (batch, n_q, HEADS, HEAD_DIM), dtype)
    k = jax.random.normal(keys[1], (batch, n_keys, KV_HEADS, HEAD_DIM), dtype)
    v = jax.random.normal(keys[2], (batch, n_keys, KV_HEADS, HEAD_DIM), dtype)
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
        print(f"[{index}/{len(shapes)}] batch={batch} canvas={n_keys} queries={n_q}", file=sys.stderr, flush=True)
        q, k, v, valid = _inputs(batch, n_q, n_keys, dtype)
        flops, bytes_moved = _cost(q, k, v, valid)
        try:
            expected = jax.jit(reference_attention)(q, k, v, valid)
        except Exception as err:  # noqa: BLE001 - e.g. the reference's [Q, L] scores do not fit
            expected, ref_error = None, f"{type(err).__name__}: {str(err).splitlines()[0][:80]}"
        for impl in impls:
            row = {"impl": impl, "batch": batch, "canvas": n_keys, "queries": n_q, "heads": HEADS,
                   "head_dim": HEAD_DIM, "dtype": args.dtype}
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


def format_table(rows, on_accelerator: bool) -> str:
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    backend = jax.default_backend()
    on_accelerator = backend != "cpu"
    impls = ["pallas", "xla"] if args.attention == "both" else [resolve_attention(args.attention)]
    kernel_options = {k: v for k, v in (("block_q", args.block_q), ("block_k", args.block_k)) if v}
    device = jax.devices()[0]
    header = {"backend": backend, "device": getattr(device, "device_kind", str(device)),
              "jax": jax.__version__, "attention": [describe_attention(i) for i in impls]}
    peaks = None
    if on_accelerator:
        print("measuring device peaks (bf16 matmul, copy bandwidth)...", file=sys.stderr, flush=True)
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
        print(format_table(rows, on_accelerator))
    return 1 if any("error" in r or r.get("nan") for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
