"""`python -m dilaserve_jax.bench.decode`: fast diffusion decoding throughput, quality and step costs.

Decodes a held-out task sample with the slot decoder for every cache mode x threshold x batch size
and prints tokens/s, steps per request, accuracy and the measured refresh / reuse step times. Then
times single refresh and reuse steps of the tiny model and of a llada_8b-shaped model with two
layers and random bf16 weights at canvas 1024, block 32: how the step-cost ratio grows with length.

With --scaling it instead measures tokens/s against batch size on a fixed random-checkpoint
workload and where a step's time goes (bench/scaling.py); --against TREE times another source
tree of this project side by side, interleaved, in the same run; --slot-shards N also times this
tree with each decoder's slots split over N devices.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dilaserve_jax.core.cli import add_config_arguments, config_from_args, opt, returns_exit_status, setup_logging
from dilaserve_jax.core.kinds import CACHE_MODES, StepKind
from dilaserve_jax.kernels import IMPLEMENTATIONS

log = logging.getLogger(__name__)
CACHES = CACHE_MODES


@dataclass(frozen=True, slots=True)
class BenchConfig:
    model: str = opt("tiny", "preset (tiny) or checkpoint directory")
    per_task: int = opt(8, "held-out problems per task")
    taus: tuple[float, ...] = opt((1.0, 0.9, 0.7, 0.5), "thresholds", metavar="TAU")
    caches: tuple[str, ...] = opt(CACHES, "cache modes", choices=CACHES)
    batches: tuple[int, ...] = opt((1, 16), "batch sizes")
    block_length: int = opt(32, "block length")
    seed: int = opt(0, "problem sampling seed")
    big_model: bool = opt(True, "time the llada_8b-shaped steps")

    def __post_init__(self):
        if not self.taus or not all(0.0 < t <= 1.0 for t in self.taus):
            raise ValueError(f"taus must be in (0, 1], got {self.taus}")
        if not set(self.caches) <= set(CACHES) or not self.caches:
            raise ValueError(f"caches must be a non-empty subset of {CACHES}")
        if not self.batches or min(self.batches) < 1 or self.per_task < 1 or self.block_length < 1:
            raise ValueError("batches, per_task and block_length must be positive")


def _sample(model, per_task: int, seed: int):
    """Held-out problems of every task that fits the model's max_len: (problem, prompt tokens, answer length)."""
    from dilaserve_jax.tasks.suite import TASKS, unique_problems

    out = []
    for name, task in TASKS.items():
        for p in unique_problems(name, "heldout", per_task, seed):
            toks = model.tokenizer.encode(p.prompt)
            if len(toks) + task.gen_length <= model.config.max_len:
                out.append((p, toks, task.gen_length))
    if not out:
        raise ValueError(f"no task problem fits max_len {model.config.max_len}")
    return out


def _length_buckets(cfg, sample) -> tuple[int, ...]:
    longest = max(len(toks) + gen for _, toks, gen in sample)
    return tuple(sorted({min(64, cfg.max_len), min(-(-longest // 64) * 64, cfg.max_len)}))


def _decoder(model, cache: str, slots: int, lengths, blocks, progress: bool):
    from dilaserve_jax.core.kinds import CacheMode
    from dilaserve_jax.decoding.decoder import DecoderConfig, SlotDecoder

    return SlotDecoder(model.config, model.graphdef, model.params,
                       DecoderConfig(slots, lengths, tuple(blocks), CacheMode(cache)), progress=progress)


def run_grid(model, cfg: BenchConfig, progress: bool) -> list[dict]:
    from dilaserve_jax.decoding.offline import DecodeRequest, generate_many
    from dilaserve_jax.tasks.graders import grade

    sample = _sample(model, cfg.per_task, cfg.seed)
    lengths = _length_buckets(model.config, sample)
    blocks = {min(gen, cfg.block_length) for _, _, gen in sample}  # answers shorter than a block
    rows = []
    for cache in cfg.caches:
        decoder = _decoder(model, cache, max(cfg.batches), lengths, blocks, progress)
        for batch in cfg.batches:
            for tau in cfg.taus:
                reqs = [DecodeRequest(tuple(toks), gen, cfg.block_length, tau) for _, toks, gen in sample]
                results, stats = generate_many(decoder, reqs, max_batch=batch, progress=progress)
                correct = sum(grade(p, model.tokenizer.decode(r.answer)) for (p, _, _), r in zip(sample, results))
                refresh = statistics.mean(stats.refresh_seconds) if stats.refresh_seconds else None
                reuse = statistics.mean(stats.reuse_seconds) if stats.reuse_seconds else None
                rows.append({"cache": cache, "tau": tau, "batch": batch, "requests": len(reqs),
                             "tokens_per_s": stats.tokens_per_second,
                             "steps_per_request": sum(r.steps for r in results) / len(results),
                             "accuracy": correct / len(results), "refresh_ms": 1e3 * refresh if refresh else None,
                             "reuse_ms": 1e3 * reuse if reuse else None,
                             "refresh_over_reuse": refresh / reuse if refresh and reuse else None,
                             "refresh_steps": len(stats.refresh_seconds), "reuse_steps": len(stats.reuse_seconds),
                             "compile_s": decoder.warm_up_seconds})
    for row in rows:
        base = next((r for r in rows if r["cache"] == "none" and r["tau"] == 1.0 and r["batch"] == row["batch"]), None)
        row["speedup_vs_none_tau1"] = row["tokens_per_s"] / base["tokens_per_s"] if base else None
        row["accuracy_delta_vs_none_tau1"] = row["accuracy"] - base["accuracy"] if base else None
    return rows


TIMING_PHRASE = "the quick brown fox jumps over the lazy dog while five boxing wizards jump quickly"


def timing_prompt(tokenizer, length: int) -> list[int]:
    """A prompt the tiny model answers at length (an `upper` copy), so no slot finishes while timed."""
    from dilaserve_jax.tasks.suite import field_prompt

    return tokenizer.encode(field_prompt("upper", TIMING_PHRASE))[: length // 2]


def time_steps(cfg, graphdef, params, *, batch: int, length: int, block: int, prompt: list[int],
               repeats: int = 3, progress: bool = False) -> dict:
    """Median wall time of one refresh step and one dual-cache reuse step at a fixed shape.

    Every slot holds `prompt`; a slot that finishes while timed (its answer ended) is an error,
    since its next step would not be the shape being measured.
    """
    from dilaserve_jax.core.kinds import CacheMode
    from dilaserve_jax.decoding.decoder import DecoderConfig, SlotDecoder

    dec = SlotDecoder(cfg, graphdef, params, DecoderConfig(batch, (length,), (block,), CacheMode.DUAL),
                      progress=progress)
    slots = list(range(batch))
    for s in slots:
        dec.admit(s, prompt, length - len(prompt), block)
    refresh, reuse = [], []
    for _ in range(repeats):  # τ = 1: one commit per step, the block never fills up here
        for kind, times in ((StepKind.REFRESH, refresh), (StepKind.REUSE, reuse)):
            t0 = time.perf_counter()
            done = dec.step(kind, slots, [1.0] * batch)
            times.append(time.perf_counter() - t0)
            if any(r.request_finished for r in done):
                raise RuntimeError("a timed slot finished its answer; time with a prompt that gets a longer answer")
    r, u = statistics.median(refresh), statistics.median(reuse)
    return {"model": cfg.name, "layers": cfg.n_layers, "batch": batch, "canvas": length, "block": block,
            "refresh_ms": 1e3 * r, "reuse_ms": 1e3 * u, "refresh_over_reuse": r / u,
            "compile_s": dec.warm_up_seconds}


def big_model_steps(progress: bool) -> dict:
    """llada_8b shape, 2 layers, random bf16 weights: one refresh and one reuse at canvas 1024, block 32."""
    from flax import nnx

    from dilaserve_jax.models.config import llada_8b
    from dilaserve_jax.models.llada import init_model

    cfg = llada_8b().replace(n_layers=2)
    graphdef, params = nnx.split(init_model(cfg, seed=0))
    filler = [3 + i % 90 for i in range(512)]  # random weights: any prompt gives a long answer
    return time_steps(cfg, graphdef, params, batch=1, length=1024, block=32, prompt=filler, repeats=2,
                      progress=progress)


def format_tables(rows: list[dict], steps: list[dict]) -> str:
    head = (f"{'cache':<7}{'tau':>5}{'batch':>6}{'tok/s':>9}{'speedup':>9}{'steps/req':>10}{'acc %':>7}"
            f"{'refresh ms':>11}{'reuse ms':>9}{'ratio':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = f"{r['refresh_over_reuse']:.1f}" if r["refresh_over_reuse"] else "-"
        reuse = f"{r['reuse_ms']:.1f}" if r["reuse_ms"] else "-"
        refresh = f"{r['refresh_ms']:.1f}" if r["refresh_ms"] else "-"
        speed = f"{r['speedup_vs_none_tau1']:.2f}x" if r["speedup_vs_none_tau1"] else "-"
        lines.append(f"{r['cache']:<7}{r['tau']:>5g}{r['batch']:>6}{r['tokens_per_s']:>9.0f}{speed:>9}"
                     f"{r['steps_per_request']:>10.1f}{100 * r['accuracy']:>7.1f}{refresh:>11}"
                     f"{reuse:>9}{ratio:>7}")
    if steps:
        lines += ["", f"{'single steps':<26}{'batch':>6}{'canvas':>7}{'block':>6}{'refresh ms':>11}"
                      f"{'reuse ms':>9}{'ratio':>7}"]
        for s in steps:
            name = f"{s['model']} ({s['layers']} layers)"
            lines.append(f"{name:<26}{s['batch']:>6}{s['canvas']:>7}{s['block']:>6}{s['refresh_ms']:>11.1f}"
                         f"{s['reuse_ms']:>9.1f}{s['refresh_over_reuse']:>7.1f}")
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class DecodeBenchCommand:
    attention: str = opt("auto", "attention implementation (auto = Pallas on GPU/TPU, XLA on CPU)",
                         choices=IMPLEMENTATIONS)
    scaling: bool = opt(False, "instead: tokens/s against batch size on a random 4-layer LLaDA-format checkpoint "
                               "(prompt 32, answer 128, block 32, one token per step) and the per-step time breakdown")
    against: str | None = opt(None, "with --scaling: also time the dilaserve_jax of this source tree, interleaved "
                                    "with this one", metavar="TREE")
    slot_shards: int = opt(1, "with --scaling: also time this tree with each decoder's slots split over N devices "
                              "(host devices on CPU; every side then runs with N), as the side 'shards'", metavar="N")
    processes: int = opt(1, "with --scaling: also time P independent worker processes of this tree, each decoding "
                            "batch / P of a cell's requests at once, as the side 'procs' (what the machine does with "
                            "the work split and no coordination; cells P does not divide show '-')", metavar="P")
    json: bool = opt(False, "print one JSON object instead of tables")
    progress: bool = opt(True, "progress bars on stderr")

    def __post_init__(self):
        for flag, value in (("--slot-shards", self.slot_shards), ("--processes", self.processes)):
            if value < 1:
                raise ValueError(f"{flag} must be positive, got {value}")


def build_parser() -> argparse.ArgumentParser:
    from dilaserve_jax.bench.scaling import ScalingConfig

    p = argparse.ArgumentParser(
        prog="python -m dilaserve_jax.bench.decode",
        description="Benchmark fast diffusion decoding: for each KV-cache mode (none, prefix, dual), confidence "
                    "threshold and batch size, decode a held-out task sample and report tokens/s, steps per "
                    "request, accuracy and measured refresh/reuse step times; then time single refresh and "
                    "reuse steps of the tiny model and of a 2-layer llada_8b-shaped model (canvas 1024).")
    add_config_arguments(p, BenchConfig, only=("model",))
    add_config_arguments(p, DecodeBenchCommand, only=("attention",))
    add_config_arguments(p, BenchConfig, exclude=("model",))
    add_config_arguments(p, DecodeBenchCommand, only=("scaling", "against", "slot_shards", "processes"))
    add_config_arguments(p, ScalingConfig, only=("batches", "breakdown_batches", "breakdown_caches", "top_ops",
                                                 "repeats"))
    return add_config_arguments(p, DecodeBenchCommand, only=("json", "progress"))


@returns_exit_status
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = config_from_args(DecodeBenchCommand, args, parser)
    setup_logging(log)
    if command.scaling:
        from dilaserve_jax.bench.scaling import ScalingConfig

        cfg = config_from_args(ScalingConfig, args, parser, caches=tuple(args.caches), block=args.block_length)
        return scaling_main(cfg, command)
    cfg = config_from_args(BenchConfig, args, parser)
    progress = command.progress
    try:
        from dilaserve_jax.models import load_model

        model = load_model(cfg.model, attention=command.attention)
    except (ValueError, FileNotFoundError) as err:
        log.error(f"error: {err}")
        return 2
    t0 = time.perf_counter()
    rows = run_grid(model, cfg, progress)
    length = model.config.max_len
    steps = [time_steps(model.config, model.graphdef, model.params, batch=b, length=length,
                        block=min(cfg.block_length, length // 2), prompt=timing_prompt(model.tokenizer, length),
                        progress=progress)
             for b in cfg.batches]
    if cfg.big_model:
        steps.append(big_model_steps(progress))
    if command.json:
        print(json.dumps({"config": asdict(cfg), "model": model.source, "grid": rows, "steps": steps,
                          "seconds": time.perf_counter() - t0}, indent=1))
    else:
        print(f"model {model.source}; {rows[0]['requests']} held-out requests per row; tok/s = committed tokens "
              f"per wall second; speedup vs (none, tau 1) at the same batch")
        print(format_tables(rows, steps))
    return 0


def scaling_main(cfg, args: DecodeBenchCommand) -> int:
    from dilaserve_jax.bench.scaling import OWN_TREE, format_scaling, run_scaling

    progress = args.progress
    trees = {"this": OWN_TREE}
    if args.slot_shards > 1:
        trees["shards"] = OWN_TREE
    if args.against:
        if not (Path(args.against) / "dilaserve_jax" / "__init__.py").exists():
            log.error(f"error: {args.against} is not a source tree of this project")
            return 2
        trees["against"] = Path(args.against)
    t0 = time.perf_counter()
    result = run_scaling(cfg, trees, progress, slot_shards={"shards": args.slot_shards}, processes=args.processes)
    if args.json:
        print(json.dumps(result | {"config": asdict(cfg), "seconds": time.perf_counter() - t0}, indent=1, default=str))
    else:
        print("tokens/s = committed tokens per wall second of generate_many, median of "
              f"{cfg.repeats} interleaved rounds after a warm-up; trees: "
              + "; ".join(f"{k} = {v}" + (f" ({result['slot_shards'][k]} slot shards)"
                                          if result["slot_shards"][k] > 1 else "")
                          + (f" ({args.processes} processes, batch / {args.processes} rows each)" if k == "procs" else "")
                          for k, v in result["trees"].items()))
        print(format_scaling(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
