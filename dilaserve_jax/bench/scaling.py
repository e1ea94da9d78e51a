"""Decode throughput against batch size on a fixed workload, optionally side by side with another
source tree (`python -m dilaserve_jax.bench.decode --scaling [--against TREE]`).

The workload: a random LLaDA-format checkpoint (SCALING_MODEL: 4 layers, d_model 256, 8 heads,
vocabulary 512, float32, LLaDA's 3 x d_model MLP) written with `save_hf_checkpoint` and loaded
with `load_model`; per row a 32-token prompt, a 128-token answer, block 32, τ = 1 (one token per
step), greedy. The LM head's EOS column is zero, so EOS (logit 0) is never the argmax of 511
random logits and every row decodes all 128 positions: every row does the same work (checked).

Each tree runs in its own worker process (bench/scaling_worker.py). Cells are timed in rounds:
a warm-up round (compiles; for none and dual it decodes one block per row, on the same decoder,
canvas bucket and executables as the timed rounds), then `repeats` rounds; within a round every (cache, batch) cell runs
in each tree back to back, the trees' order alternating between rounds, so both see the same
machine load. tokens/s = committed tokens / wall seconds of generate_many; tokens/cpu-s = the same
tokens / the worker's CPU seconds (all threads), a measure of work that a busy shared machine
disturbs less than wall time; the median round of each is kept. Digests of the answers must agree across rounds and trees (same greedy tokens).

A side may split its decoders' slots over several devices (`slot_shards`, decoding/slot_shards.py;
on CPU, host devices): every worker then runs with that many host devices, so the sides differ
only in how they use them. A side with D shards decodes batch b on ceil(b / D) * D slots (batch 1
on 2 shards: one real row and one padding row, on the other device).

A side may also be P independent worker processes of this tree (`processes`, the side "procs"):
each decodes its own batch / P of the cell's requests on its own decoder, all at once, and the
side's tokens/s is every process's tokens over the wall time from the first command sent to the
last reply. No process waits for another or shares anything with it, so this is what the machine
does with the work when it is split with no coordination at all: where its curve goes flat, the
machine is saturated, whatever one process does. A cell whose batch P does not divide is left out
("-") for that side; its digest covers the processes' answers in request order.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from dilaserve_jax.bench.scaling_worker import answers_digest
from dilaserve_jax.core.cli import opt
from dilaserve_jax.core.kinds import CACHE_MODES
from dilaserve_jax.models.config import ModelConfig

WORKER = Path(__file__).with_name("scaling_worker.py")
OWN_TREE = Path(__file__).resolve().parents[2]
CACHES = CACHE_MODES
BREAKDOWN_REPEATS = 5
# Steps one breakdown takes inside the first block (τ 1: one commit each): the refresh after
# admission, time_step_parts (2 * repeats + 1) and stage_profile (1 + 3).
BREAKDOWN_STEPS = 1 + 2 * BREAKDOWN_REPEATS + 1 + 4

SCALING_MODEL = ModelConfig(
    name="llada-random-4x256", vocab_size=512, d_model=256, n_layers=4, n_heads=8, n_kv_heads=8, head_dim=32,
    mlp_hidden=768, max_len=512, mask_id=2, eos_id=1, pad_id=0)


@dataclass(frozen=True, slots=True)
class ScalingConfig:
    batches: tuple[int, ...] = opt((1, 8, 16, 32, 64), "with --scaling: batch sizes", name="--scaling-batches")
    caches: tuple[str, ...] = CACHES
    prompt: int = 32
    answer: int = 128
    block: int = 32
    repeats: int = opt(3, "with --scaling: timed rounds after warm-up")
    breakdown_batches: tuple[int, ...] = opt((1, 8, 32), "with --scaling: batch sizes of the per-step breakdown "
                                                         "(none to skip)", nargs="*")
    breakdown_caches: tuple[str, ...] = opt(("dual",), "with --scaling: cache modes of the per-step breakdown",
                                            choices=CACHES)
    seed: int = 0
    top_ops: int = opt(0, "with --scaling: also list the N largest XLA operations of every breakdown step",
                       metavar="N")

    def __post_init__(self):
        if not self.batches or min(self.batches) < 1 or min(self.breakdown_batches, default=1) < 1:
            raise ValueError("batch sizes must be positive")
        if not self.caches or not set(self.caches) | set(self.breakdown_caches) <= set(CACHES):
            raise ValueError(f"caches must be a non-empty subset of {CACHES}")
        if self.top_ops < 0:
            raise ValueError(f"top_ops must not be negative, got {self.top_ops}")
        if min(self.prompt, self.answer, self.block, self.repeats) < 1:
            raise ValueError("prompt, answer, block and repeats must be positive")
        if self.breakdown_batches and min(self.block, self.answer) < BREAKDOWN_STEPS:
            raise ValueError(f"a breakdown takes {BREAKDOWN_STEPS} steps inside one block: block and answer must be "
                             f">= {BREAKDOWN_STEPS}")
        if self.prompt + self.answer > SCALING_MODEL.max_len:
            raise ValueError(f"prompt + answer must fit {SCALING_MODEL.max_len} positions")


def write_checkpoint(directory: str | Path, seed: int = 0) -> Path:
    """The random benchmark checkpoint (see the module docstring) plus a word-level tokenizer.json."""
    from flax import nnx
    from tokenizers import Tokenizer, models, pre_tokenizers

    from dilaserve_jax.models.hf import save_hf_checkpoint
    from dilaserve_jax.models.llada import init_model

    cfg = SCALING_MODEL
    model = init_model(cfg, seed)
    model.lm_head.kernel[...] = model.lm_head.kernel[...].at[:, cfg.eos_id].set(0.0)
    save_hf_checkpoint(directory, cfg, nnx.split(model)[1])
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(cfg.vocab_size)}, unk_token=f"t{cfg.pad_id}"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(Path(directory) / "tokenizer.json"))
    return Path(directory)


class Worker:
    """A scaling_worker.py process importing dilaserve_jax from `tree`."""

    def __init__(self, label: str, tree: str | Path, checkpoint: Path, slot_shards: int = 1, host_devices: int = 1):
        self.label, self.tree, self.slot_shards = label, str(tree), slot_shards
        env = dict(os.environ)
        if host_devices > 1:  # every worker sees the same devices, whether it splits its slots or not
            flag = f"--xla_force_host_platform_device_count={host_devices}"
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
        self.proc = subprocess.Popen([sys.executable, str(WORKER), self.tree, str(checkpoint), str(slot_shards)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.source = self._read()["ready"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.label} worker ({self.tree}) exited with {self.proc.wait()}")
        return json.loads(line)

    def send(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def receive(self) -> dict:
        reply = self._read()
        if "error" in reply:
            raise RuntimeError(f"{self.label}: {reply['error']}")
        return reply

    def ask(self, **cmd) -> dict:
        self.send(**cmd)
        return self.receive()

    def generate(self, batch: int, **cmd) -> dict:
        return self.ask(op="generate", batch=batch, **cmd)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


class ProcessGroup:
    """P workers of one tree that decode one cell together, each its own batch / P requests, at once
    (the "procs" side; see the module docstring)."""

    def __init__(self, label: str, workers: list[Worker]):
        self.label, self.workers = label, workers
        self.source = workers[0].source

    def generate(self, batch: int, **cmd) -> dict | None:
        count = len(self.workers)
        if batch % count:
            return None
        part = batch // count
        t0 = time.perf_counter()
        for i, w in enumerate(self.workers):
            w.send(op="generate", batch=batch, rows=[i * part, (i + 1) * part], answers=True, **cmd)
        replies = [w.receive() for w in self.workers]
        seconds = time.perf_counter() - t0
        answers = [a for r in replies for a in r["answers"]]
        return {"seconds": seconds, "cpu_seconds": sum(r["cpu_seconds"] for r in replies),
                "tokens": sum(r["tokens"] for r in replies), "digest": answers_digest(answers)}

    def close(self) -> None:
        for w in self.workers:
            w.close()


def run_scaling(cfg: ScalingConfig, trees: dict[str, str | Path], progress: bool = True,
                checkpoint_dir: str | Path | None = None, slot_shards: dict[str, int] | None = None,
                processes: int = 1) -> dict:
    """Time every (cache, batch) cell in every tree, interleaved; then the per-step breakdowns.
    `slot_shards`: label -> slot shards of that side's decoders (default 1); with any above 1,
    every worker runs on that many host devices. `processes` > 1 adds the side "procs": that many
    independent workers of this tree splitting each cell, placed before the last side when there
    are several (the last stays the reference of the ratios)."""
    from tqdm.auto import tqdm

    if processes < 1:
        raise ValueError(f"processes must be positive, got {processes}")
    shards = {label: (slot_shards or {}).get(label, 1) for label in trees}
    devices = max(shards.values())
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = write_checkpoint(checkpoint_dir or tmp, cfg.seed)
        workers: list = []
        try:
            workers += [Worker(label, tree, checkpoint, shards[label], devices) for label, tree in trees.items()]
            if processes > 1:
                group = ProcessGroup("procs", [Worker(f"procs[{i}]", OWN_TREE, checkpoint, 1, devices)
                                               for i in range(processes)])
                workers.insert(max(len(workers) - 1, 1), group)
                shards["procs"] = 1
            cells = [(c, b) for c in cfg.caches for b in cfg.batches]
            shape = {"prompt": cfg.prompt, "answer": cfg.answer, "block": cfg.block, "seed": cfg.seed}
            runs: dict[tuple, list[dict]] = {}
            bar = tqdm(total=(1 + cfg.repeats) * len(cells) * len(workers), desc="scaling cells", unit="run",
                       file=sys.stderr, disable=not progress)
            for rnd in range(1 + cfg.repeats):  # round 0 warms up (compiles) and is not kept
                order = workers if rnd % 2 == 0 else workers[::-1]
                for cache, batch in cells:
                    for w in order:
                        bar.set_postfix_str(f"round {rnd} {w.label} {cache} b{batch}")
                        # Warm-up: one block per row, except prefix, whose query buckets follow
                        # what is left of the answer (a short answer would not compile them all).
                        short = rnd == 0 and cache != "prefix"
                        warm_up = {"run_answer": min(cfg.block, cfg.answer)} if short else {}
                        reply = w.generate(batch, cache=cache, **shape, **warm_up)
                        if reply is None:  # a process group whose size does not divide the batch
                            bar.update(1)
                            continue
                        if rnd and reply["tokens"] != batch * cfg.answer:
                            raise RuntimeError(f"{w.label} {cache} b{batch}: {reply['tokens']} tokens committed, "
                                               f"expected {batch * cfg.answer} (a row finished early)")
                        if rnd:
                            runs.setdefault((w.label, cache, batch), []).append(reply)
                        bar.update(1)
            bar.close()
            rows = []
            for cache, batch in cells:
                row = {"cache": cache, "batch": batch}
                digests = set()
                for w in workers:
                    got = runs.get((w.label, cache, batch))
                    if not got:  # left out for this side
                        row[w.label] = row[w.label + "_cpu"] = None
                        row[w.label + "_all"] = []
                        continue
                    row[w.label] = statistics.median(r["tokens"] / r["seconds"] for r in got)
                    row[w.label + "_all"] = [r["tokens"] / r["seconds"] for r in got]
                    row[w.label + "_cpu"] = statistics.median(r["tokens"] / r["cpu_seconds"] for r in got)
                    digests |= {r["digest"] for r in got}
                row["same_tokens"] = len(digests) == 1
                rows.append(row)
            breakdown = []
            for cache in cfg.breakdown_caches:
                for batch in cfg.breakdown_batches:
                    for w in workers:
                        if isinstance(w, ProcessGroup):  # its steps are this tree's one-device steps
                            continue
                        parts = w.ask(op="breakdown", cache=cache, batch=batch, repeats=BREAKDOWN_REPEATS,
                                      top_ops=cfg.top_ops, **shape)
                        breakdown.extend({"tree": w.label, "cache": cache, "batch": batch, "kind": kind, **p}
                                         for kind, p in parts.items())
        finally:
            for w in workers:
                w.close()
    return {"config": cfg, "trees": {w.label: w.source for w in workers}, "slot_shards": shards, "rows": rows,
            "breakdown": breakdown, "matmul_gflops": matmul_ceiling(cfg)}


def matmul_ceiling(cfg: ScalingConfig) -> dict[int, float]:
    """XLA's float32 rate for the model's largest product ([M, d_model] x [d_model, MLP]) at the row
    counts of the workload's steps (M = batch x block for a dual reuse step, batch x canvas for a
    refresh), measured here after the workers have stopped: where the machine stops speeding up
    with batch, whatever the decoder does."""
    from dilaserve_jax.bench.step_profile import dense_matmul_rate

    rows = sorted({b * cfg.block for b in cfg.batches} | {b * (cfg.prompt + cfg.answer) for b in cfg.batches})
    return {m: dense_matmul_rate(m, SCALING_MODEL.d_model, SCALING_MODEL.mlp_hidden) for m in rows}


def format_top_ops(breakdown: list[dict]) -> list[str]:
    """Each breakdown step's largest XLA operations (thread-busy ms per step), where it has them."""
    lines = []
    for b in breakdown:
        if b.get("top_ops"):
            lines += ["", f"largest operations: {b['tree']} {b['cache']} batch {b['batch']} {b['kind']} "
                          f"(busy ms per step, stage, kind, what)"]
            lines += [f"  {op['busy_ms']:>8.2f}  {op['stage']:<12} {op['kind']:<14} {op['name']:<28} {op['what']}"
                      for op in b["top_ops"]]
    return lines


def _cell(value: float | None, width: int) -> str:  # a side left out of a cell shows "-"
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.0f}"


def _ratio(value: float | None, ref: float | None) -> str:
    return f"{'-':>16}" if value is None or ref is None else f"{value / ref:>15.2f}x"


def format_scaling(result: dict) -> str:
    """The tokens/s table; with several sides, each one's ratio to the last (the reference)."""
    labels = list(result["trees"])
    others, ref = labels[:-1], labels[-1]

    def ratio_head(label: str) -> str:
        return "ratio" if len(labels) == 2 else f"{label}/{ref}"

    head = f"{'cache':<7}{'batch':>6}" + "".join(f"{label + ' tok/s':>16}" for label in labels)
    if others:
        head += "".join(f"{ratio_head(label):>16}" for label in others) + f"{'same tokens':>13}"
    head += "".join(f"{label + ' tok/cpu-s':>18}" for label in labels)
    head += "".join(f"{ratio_head(label):>16}" for label in others)
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        line = f"{r['cache']:<7}{r['batch']:>6}" + "".join(_cell(r[label], 16) for label in labels)
        if others:
            line += "".join(_ratio(r[label], r[ref]) for label in others)
            line += f"{'yes' if r['same_tokens'] else 'NO':>13}"
        line += "".join(_cell(r[label + "_cpu"], 18) for label in labels)
        line += "".join(_ratio(r[label + "_cpu"], r[ref + "_cpu"]) for label in others)
        lines.append(line)
    if result["breakdown"]:
        stages = list(dict.fromkeys(s for b in result["breakdown"] for s in b["busy_ms"]))
        kinds = list(dict.fromkeys(k for b in result["breakdown"] for k in b.get("kind_busy_ms", {})))
        lines += ["", "per step (ms, medians; outside = the host's part of a step, timed inside it; out % = outside / step, "
                      "min % = the smallest outside / the fastest step; "
                      "stages and op kinds = CPU-thread busy ms inside the compiled step)",
                  f"{'tree':<10}{'cache':<7}{'batch':>6} {'kind':<8}{'step':>8}{'compiled':>9}{'outside':>8}"
                  f"{'out %':>6}{'min %':>6}{'copy':>6}" + "".join(f"{s[:11]:>12}" for s in stages)
                  + "".join(f"{k[:11]:>12}" for k in kinds) + f"{'GFLOP':>7}{'MB':>7}{'GFLOP/s':>8}"]
        for b in result["breakdown"]:
            lines.append(f"{b['tree']:<10}{b['cache']:<7}{b['batch']:>6} {b['kind']:<8}{b['step_ms']:>8.2f}"
                         f"{b['compiled_ms']:>9.2f}{b['outside_ms']:>8.2f}{100 * b['outside_ms'] / b['step_ms']:>6.1f}"
                         f"{100 * b['outside_min_ms'] / b['step_min_ms']:>6.1f}"
                         f"{b['result_copy_ms']:>6.2f}" + "".join(f"{b['busy_ms'].get(s, 0.0):>12.2f}" for s in stages)
                         + "".join(f"{b.get('kind_busy_ms', {}).get(k, 0.0):>12.2f}" for k in kinds)
                         + f"{b['flops'] / 1e9:>7.2f}{b['bytes_accessed'] / 1e6:>7.0f}"
                         + f"{b['flops'] / 1e6 / b['compiled_min_ms']:>8.0f}")
        lines.append("GFLOP/s = the step's FLOPs over its fastest compiled run")
        lines += format_top_ops(result["breakdown"])
    if result.get("matmul_gflops"):
        lines += ["", "the machine's ceiling: XLA float32 [M x d_model] . [d_model x MLP] product, GFLOP/s (fastest of 5)",
                  "  " + "  ".join(f"M={m}: {r:.0f}" for m, r in sorted(result["matmul_gflops"].items()))]
    return "\n".join(lines)
