"""`python -m dilaserve_jax.bench.profile --out profile.json`: measure the step-latency profile.

Compiles the real refresh and reuse steps of a model for every (batch, canvas length, block) of a
grid, times them on this machine's devices (`serving.executor.profiling.measure_profile`) and writes the
profile JSON that `serving.policy.latency.LatencyModel.from_profile` and `serve --profile` read. Then fits
the latency model on a random part of the points, prints its error on the held-out rest per step
kind, and the refresh / reuse time ratio at each canvas length. With `--analytic-out DIR` it also
writes analytic roofline profiles (LLaDA-8B on A100 / H100 / H200; estimates, not measurements,
labelled `"analytic": true`).
"""
from __future__ import annotations

import argparse
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from dilaserve_jax.core.cli import add_config_arguments, config_from_args, opt, returns_exit_status, setup_logging
from dilaserve_jax.core.kinds import CACHE_MODES
from dilaserve_jax.kernels import IMPLEMENTATIONS
from dilaserve_jax.serve import DEFAULT_COMPILE_CACHE

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ProfileConfig:
    out: str = opt(help="where to write the measured profile JSON")
    model: str = opt("tiny", "preset (tiny, test) or checkpoint directory")
    attention: str = opt("auto", "attention implementation (auto = Pallas on GPU/TPU, XLA on CPU)",
                         choices=IMPLEMENTATIONS)
    batches: tuple[int, ...] = opt((1, 2, 4, 8), "batch sizes")
    lengths: tuple[int, ...] | None = opt(None, "canvas lengths",
                                          default_text="max_len/4, max_len/2, max_len of the model")
    blocks: tuple[int, ...] = opt((8, 16, 32), "block lengths")
    tp: tuple[int, ...] = opt((1,), "TP degrees to profile, one instance each (on CPU, fake devices are presented)")
    cache_mode: str = opt("dual", "KV cache mode", name="--cache", aliases=("--cache-mode",), choices=CACHE_MODES)
    repeats: int = opt(3, "timed runs per point; the median is kept")
    holdout: float = opt(0.25, "fraction of points held out of the fit")
    seed: int = opt(0, "seed of the held-out split and the dummy prompts")
    analytic_out: str | None = opt(None, "directory for analytic LLaDA-8B roofline profiles")
    compile_cache: str = opt(DEFAULT_COMPILE_CACHE, "persistent XLA compilation cache directory, or 'none'")
    progress: bool = opt(True, "progress bars on stderr")

    def __post_init__(self):
        if min(self.tp) < 1 or min(self.batches) < 1 or self.repeats < 1 or not 0 <= self.holdout < 1:
            raise ValueError("--tp, --batches and --repeats must be positive, --holdout in [0, 1)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dilaserve_jax.bench.profile",
        description="Measure refresh/reuse step latencies of a model over a (batch, canvas length, block) grid, "
                    "write the profile JSON, report the latency-model fit error on held-out points and the "
                    "refresh/reuse ratio per length; optionally write analytic LLaDA-8B roofline profiles.")
    return add_config_arguments(p, ProfileConfig)


def _present_cpu_devices(n: int) -> None:
    """Fake CPU devices for TP > 1 (must happen before JAX initialises; harmless on accelerators)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if n > 1 and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def _runner(model, tp: int, args, lengths, compiled):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from dilaserve_jax.decoding.state import init_state, state_shardings
    from dilaserve_jax.mesh.layout import Instance
    from dilaserve_jax.mesh.placement import place_params
    from dilaserve_jax.mesh.sharding import kv_cache_sharding
    from dilaserve_jax.serving.executor.runner import JaxRunner

    cfg = model.config
    if tp > len(jax.devices()):
        raise ValueError(f"TP {tp} needs {tp} devices; {len(jax.devices())} present")
    params, sharding = model.params, None
    if tp > 1:
        inst = Instance.over(0, jax.devices()[:tp])
        params = place_params(model.params, inst, cfg)
        template = init_state(cfg, 1, 1, with_cache=args.cache_mode != "none")
        sharding = state_shardings(template, kv_cache_sharding(inst, cfg), NamedSharding(inst.mesh, PartitionSpec()))
    return JaxRunner(cfg, model.graphdef, params, num_slots=max(args.batches), length_buckets=lengths,
                     block_buckets=tuple(args.blocks), cache_mode=args.cache_mode, tp_degree=tp,
                     state_sharding=sharding, compiled=compiled, progress=args.progress)


def _ratio_lines(profile) -> list[str]:
    from dilaserve_jax.serving.executor.profiling import refresh_reuse_ratios

    ratios = refresh_reuse_ratios(profile)
    batches = sorted({b for row in ratios.values() for b in row})
    lines = ["refresh / reuse step time (geometric mean over blocks):",
             "  length " + "".join(f"{'B=' + str(b):>8}" for b in batches)]
    for length, row in ratios.items():
        lines.append(f"  {length:>6} " + "".join(f"{row[b]:>8.2f}" if b in row else f"{'-':>8}" for b in batches))
    return lines


@returns_exit_status
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = config_from_args(ProfileConfig, parser.parse_args(argv), parser)
    setup_logging(log)
    _present_cpu_devices(max(args.tp))
    from dilaserve_jax.decoding.compiled import CompiledSteps, enable_compile_cache
    from dilaserve_jax.models import load_model
    from dilaserve_jax.serving.policy.latency import Profile, fit
    from dilaserve_jax.serving.executor.profiling import measure_profile

    enable_compile_cache(args.compile_cache)
    try:
        model = load_model(args.model, attention=args.attention)
        cfg = model.config
        lengths = tuple(sorted(set(args.lengths or (cfg.max_len // 4, cfg.max_len // 2, cfg.max_len))))
        compiled = CompiledSteps(cfg, model.graphdef)
        points, labels = [], []
        for tp in sorted(set(args.tp)):
            t0 = time.perf_counter()
            runner = _runner(model, tp, args, lengths, compiled)
            log.info(f"TP {tp}: compiled {len(runner.decoder.config.step_shapes())} step shapes in "
                f"{time.perf_counter() - t0:.1f} s")
            prof = measure_profile(runner, batches=args.batches, lengths=lengths, blocks=args.blocks,
                                   repeats=args.repeats, progress=args.progress, model_name=cfg.name,
                                   seed=args.seed)
            points.extend(prof.points)
            labels.append(prof)
    except (ValueError, FileNotFoundError) as err:
        log.error(f"error: {err}")
        return 2
    first = labels[0]
    label = first.label if len(labels) == 1 else f"{first.label} (and TP {', '.join(map(str, sorted(set(args.tp))[1:]))})"
    profile = Profile(label, False, first.device, first.model, tuple(points))
    profile.save(args.out)
    print(f"wrote {len(points)} measured points to {args.out}: {profile.label}")
    report = fit(profile.points, args.holdout, args.seed).report
    print(f"latency-model fit, {report}")
    print("\n".join(_ratio_lines(profile)))
    if args.analytic_out:
        from dilaserve_jax.serving.policy.roofline import CHIPS, analytic_profile

        out = Path(args.analytic_out)
        out.mkdir(parents=True, exist_ok=True)
        for name in CHIPS:
            ana = analytic_profile(name)
            path = out / f"llada8b_{name}.analytic.json"
            ana.save(path)
            print(f"wrote {path} (ANALYTIC, not measured): {ana.label}; "
                  f"fit {fit(ana.points, args.holdout, args.seed).report}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
