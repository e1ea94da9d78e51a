"""Measure live resharding between layouts: seconds and bytes per transition.

    python -m dilaserve_jax.bench.reshard --model tiny --model llada_8b --layers 2 --json reshard.json

Random weights are generated directly on the devices in their sharded places (no host copy), then
moved through a cycle of layouts twice: the first pass ("cold") includes compiling the all-gathers,
the second ("warm") is the steady-state cost. Transitions whose peak memory (old and new copies
together) would exceed --memory-budget-gb are skipped and reported as such. On fake CPU devices
the seconds are host memcpy speed, not accelerator interconnect speed; bytes are exact.
"moved" counts bytes that arrive on a device that did not hold them; "held" is what the new layout
holds in all (split parameters once per instance, replicated ones once per device).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import dataclass

from dilaserve_jax.core.cli import add_config_arguments, config_from_args, opt, returns_exit_status, setup_logging

log = logging.getLogger(__name__)
DEFAULT_CYCLE = ("1x8", "2x4", "4x2", "8x1", "4+2+1+1", "1x8")


@dataclass(frozen=True, slots=True)
class ReshardConfig:
    model: tuple[str, ...] = opt(("tiny", "llada_8b"), "model preset (repeatable)", repeat=True)
    layers: int = opt(2, "layer cap for billion-parameter presets (2: llada_8b-shaped with 2 layers keeps its full "
                         "126k x 4096 embeddings); small presets keep all their layers")
    cycle: str = opt(",".join(DEFAULT_CYCLE), "comma-separated layouts to visit in order")
    devices: int = opt(8, "fake CPU devices to create when running on CPU")
    passes: int = opt(2, "times to go round the cycle (2: cold, warm)")
    memory_budget_gb: float | None = opt(None, "skip transitions needing more", default_text="60% of available memory")
    json: str | None = opt(None, "also write the results as JSON", metavar="PATH")

    def __post_init__(self):
        if self.passes < 1 or self.layers < 1 or self.devices < 1:
            raise ValueError("--passes, --layers and --devices must be positive")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dilaserve_jax.bench.reshard",
                                description="Time and count the bytes of resharding model weights between device "
                                            "layouts (e.g. 1x8 -> 2x4 -> 8x1) on this machine's devices.")
    return add_config_arguments(p, ReshardConfig)


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info.get("MemAvailable", info["MemTotal"])
    except (OSError, KeyError, ValueError):
        return 16 * 2**30


def _held_bytes(abstract, layout, cfg) -> int:
    """Bytes all instances of `layout` hold: split parameters once per instance, replicated ones once per device."""
    from jax.sharding import PartitionSpec

    from dilaserve_jax.mesh import partition_spec

    total = 0
    for inst in layout.instances:
        for path, leaf in _flat(abstract):
            size = leaf.size * leaf.dtype.itemsize
            total += size if partition_spec(path, cfg, inst.tp) != PartitionSpec() else size * inst.tp
    return total


def _flat(tree):
    import jax

    from dilaserve_jax.mesh.sharding import param_path

    return [(param_path(kp), leaf) for kp, leaf in jax.tree_util.tree_leaves_with_path(tree)]


def _random_params(cfg, abstract, instance):
    """Random weights generated on the instance's devices, already in their shards."""
    import jax

    from dilaserve_jax.mesh import param_shardings

    shardings = param_shardings(abstract, instance, cfg)
    leaves, treedef = jax.tree_util.tree_flatten(abstract)
    out = []
    for k, (leaf, sharding) in enumerate(zip(leaves, jax.tree_util.tree_leaves(shardings))):
        make = jax.jit(lambda key, s=leaf.shape, d=leaf.dtype: jax.random.normal(key, s, d), out_shardings=sharding)
        out.append(make(jax.random.PRNGKey(k)))
    return jax.tree_util.tree_unflatten(treedef, out)


def bench_model(name: str, args, budget: int, log) -> list[dict]:
    import jax

    from dilaserve_jax.mesh import Layout, replicate_to_instances, reshard
    from dilaserve_jax.models import config as presets
    from dilaserve_jax.models.hf import abstract_params

    cfg = presets.preset(name)
    if cfg.num_params > 1e9:
        cfg = cfg.replace(n_layers=min(cfg.n_layers, args.layers))
    _, abstract = abstract_params(cfg)
    model_bytes = sum(leaf.size * leaf.dtype.itemsize for _, leaf in _flat(abstract))
    cycle = [Layout.build(spec, jax.devices()[:args.devices], config=cfg) for spec in args.cycle.split(",")]
    log(f"{name}: {cfg.n_layers} layers, {cfg.param_dtype}, {model_bytes / 2**30:.2f} GiB per copy; "
        f"cycle {' -> '.join(str(lay.spec) for lay in cycle)} x{args.passes}")
    current = cycle[0]
    first = current.instances[0]
    if _held_bytes(abstract, current, cfg) > budget:
        log(f"  {name}: even {current.spec} needs more than the memory budget; skipped")
        return []
    params = replicate_to_instances(_random_params(cfg, abstract, first), first, current, cfg)
    rows: dict[tuple, dict] = {}
    steps = [(p, k) for p in range(args.passes) for k in range(1, len(cycle))]
    for n, (pass_no, k) in enumerate(steps, 1):
        target = cycle[k]
        peak = _held_bytes(abstract, current, cfg) + _held_bytes(abstract, target, cfg)
        key = (k, str(current.spec), str(target.spec))
        row = rows.setdefault(key, {"model": name, "layers": cfg.n_layers, "from": str(current.spec),
                                    "to": str(target.spec), "model_bytes": model_bytes, "peak_bytes": peak,
                                    "seconds": []})
        if peak > budget:
            row["skipped"] = f"needs {peak / 2**30:.1f} GiB > budget {budget / 2**30:.1f} GiB"
            log(f"  [{n}/{len(steps)}] {current.spec} -> {target.spec}: skipped ({row['skipped']})")
            continue
        new_params, report = reshard(params, current, target, cfg)
        params, current = new_params, target  # the old copies are dropped here
        row.update(bytes_moved=report.bytes_moved, bytes_gathered=report.bytes_gathered, bytes_total=report.bytes_total)
        row["seconds"].append(report.seconds)
        log(f"  [{n}/{len(steps)}] pass {pass_no + 1}: {report}")
    del params
    return list(rows.values())


def format_table(rows: list[dict]) -> str:
    head = f"{'model':<10} {'from':>8} {'to':>8} {'moved MiB':>10} {'gathered MiB':>13} {'held MiB':>9} " \
           f"{'cold ms':>9} {'warm ms':>9} {'GB/s':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        name = f"{r['model']}/{r['layers']}L"
        if "skipped" in r or not r["seconds"]:
            lines.append(f"{name:<10} {r['from']:>8} {r['to']:>8}   skipped: {r.get('skipped', 'not reached')}")
            continue
        cold, warm = r["seconds"][0], r["seconds"][-1]
        rate = r["bytes_moved"] / warm / 1e9 if warm > 0 else 0.0
        lines.append(f"{name:<10} {r['from']:>8} {r['to']:>8} {r['bytes_moved'] / 2**20:>10.1f} "
                     f"{r['bytes_gathered'] / 2**20:>13.1f} {r['bytes_total'] / 2**20:>9.1f} {cold * 1e3:>9.1f} "
                     f"{warm * 1e3:>9.1f} {rate:>6.2f}")
    return "\n".join(lines)


@returns_exit_status
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = config_from_args(ReshardConfig, parser.parse_args(argv), parser)
    setup_logging(log)
    if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.devices}").strip()
    import jax

    if len(jax.devices()) < args.devices:
        raise SystemExit(f"need {args.devices} devices, have {len(jax.devices())} ({jax.default_backend()})")
    budget = int(args.memory_budget_gb * 2**30) if args.memory_budget_gb else int(0.6 * _available_bytes())
    log.info(f"jax {jax.__version__}, {args.devices} {jax.default_backend()} devices, memory budget "
             f"{budget / 2**30:.1f} GiB")
    start = time.perf_counter()
    rows = [row for name in args.model for row in bench_model(name, args, budget, log.info)]
    print(format_table(rows))
    log.info(f"done in {time.perf_counter() - start:.1f} s")
    if args.json:
        meta = {"jax": jax.__version__, "backend": jax.default_backend(), "devices": args.devices,
                "passes": args.passes, "memory_budget_bytes": budget}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
