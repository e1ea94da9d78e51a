"""`python -m dilaserve_jax.bench.compile_cache`: what one serving instance's executables cost to
build cold (compiled) and warm (loaded from the persistent compile cache).

Each pass is a fresh process, as a restarted server or a newly built instance is: it turns on the
persistent cache at one directory, places the model on the first device and builds a decoder's
executables for every step shape of the given length buckets (`SlotDecoder(..., warm_up=True)`,
what `serve` does per instance). The first pass finds the cache empty and compiles; the later ones
load. This is the `load_s` / `compile_s` pair the cluster simulator charges per new instance of a
layout switch (`sim --load-s --compile-s`, docs/simulation.md).

`--model llada_8b --layers N` builds an LLaDA-8B-shaped model of N layers with random weights (the
layers are unrolled in the program, so compile and load grow with N).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from dilaserve_jax.core.cli import add_config_arguments, config_from_args, opt, returns_exit_status


@dataclass(frozen=True, slots=True)
class CompileCacheConfig:
    model: str = opt("tiny", "a preset (tiny, test, llada_8b, ...) or a checkpoint directory")
    layers: int | None = opt(None, "build the preset with this many layers and random weights "
                                   "(the llada_8b preset's 32 would take long to compile)")
    lengths: tuple[int, ...] = opt((64, 128, 256), "length buckets (each adds one executable per step kind)")
    slots: int = opt(8, "decode slots of the instance")
    passes: int = opt(2, "processes in turn on one cache directory (the first compiles, the others load)")
    cache_dir: str | None = opt(None, "the persistent cache directory", default_text="a fresh temporary directory")
    json: bool = opt(False, "print the passes as a JSON array")
    pass_: bool = opt(False, "internal: run one pass in this process and print its JSON line", name="--one-pass")

    def __post_init__(self):
        if self.passes < 1 or self.slots < 1 or not self.lengths or min(self.lengths) < 1:
            raise ValueError("passes, slots and every length must be >= 1")
        if self.layers is not None and self.layers < 1:
            raise ValueError("--layers must be >= 1")


def one_pass(cfg: CompileCacheConfig) -> dict:
    """Build one instance's executables in this process (the cache must already be on)."""
    import jax
    from flax import nnx

    from dilaserve_jax.decoding.decoder import DecoderConfig, SlotDecoder
    from dilaserve_jax.models import init_model, load_model, preset

    t0 = time.perf_counter()
    if cfg.layers is None:
        m = load_model(cfg.model)
        mc, graphdef, params = m.config, m.graphdef, m.params
    else:
        mc = preset(cfg.model).replace(n_layers=cfg.layers)
        graphdef, params = nnx.split(init_model(mc, seed=0))
    params = jax.block_until_ready(jax.device_put(params, jax.devices()[0]))
    model_s = time.perf_counter() - t0
    lengths = tuple(n for n in cfg.lengths if n <= mc.max_len)
    if not lengths:
        raise ValueError(f"every length bucket exceeds the model's max_len {mc.max_len}")
    dec = SlotDecoder(mc, graphdef, params, DecoderConfig(cfg.slots, lengths, (32,), "dual"), warm_up=True,
                      progress=False)
    return {"model": mc.name, "layers": mc.n_layers, "lengths": list(lengths), "backend": jax.default_backend(),
            "device": jax.devices()[0].device_kind, "executables": len(dec.step_shapes()),
            "model_s": round(model_s, 3), "build_s": round(dec.warm_up_seconds, 3)}


def _files_in(directory: str) -> int:
    return sum(len(files) for _, _, files in os.walk(directory))


def run_passes(cfg: CompileCacheConfig, argv: list[str]) -> list[dict]:
    """`cfg.passes` fresh processes in turn on one cache directory; each pass's row, with its wall time."""
    cache = cfg.cache_dir or tempfile.mkdtemp(prefix="dilaserve-compile-cache-")
    rows = []
    for i in range(cfg.passes):
        before = _files_in(cache)
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "dilaserve_jax.bench.compile_cache", *argv, "--one-pass",
                              "--cache-dir", cache], capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"pass {i + 1} failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
        row = json.loads(out.stdout.strip().splitlines()[-1])
        row |= {"pass": i + 1, "process_s": round(time.perf_counter() - t0, 3),
                "cache_files_before": before, "cache_files_after": _files_in(cache)}
        rows.append(row)
        print(f"pass {i + 1}/{cfg.passes}: {row['executables']} executables in {row['build_s']:.2f} s",
              file=sys.stderr, flush=True)
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dilaserve_jax.bench.compile_cache",
        description="Build one serving instance's decode-step executables in fresh processes on one persistent "
                    "compile cache: the first pass compiles (cold), the later ones load from the cache (warm).")
    return add_config_arguments(p, CompileCacheConfig)


@returns_exit_status
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    cfg = config_from_args(CompileCacheConfig, parser.parse_args(argv), parser)
    if cfg.pass_:
        from dilaserve_jax.decoding.compiled import enable_compile_cache

        if not cfg.cache_dir:
            parser.error("--one-pass needs --cache-dir")
        enable_compile_cache(cfg.cache_dir)
        print(json.dumps(one_pass(cfg)), flush=True)
        return 0
    rows = run_passes(cfg, argv)  # a pass prints its JSON line whatever --json says
    if cfg.json:
        print(json.dumps(rows, indent=1))
        return 0
    r0 = rows[0]
    print(f"# {r0['model']} ({r0['layers']} layers), lengths {r0['lengths']}, {r0['executables']} executables; "
          f"backend {r0['backend']} ({r0['device']})")
    print(f"{'pass':>4} {'cache files':>12} {'model s':>8} {'build s':>8} {'process s':>10}")
    for r in rows:
        print(f"{r['pass']:>4} {r['cache_files_before']:>5} -> {r['cache_files_after']:<4} {r['model_s']:>8.2f} "
              f"{r['build_s']:>8.2f} {r['process_s']:>10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
