"""`python -m dilaserve_jax.tasks.eval`: accuracy and decoding speed per task and confidence threshold.

For every task and threshold it decodes the same held-out problems and reports the valid-answer
rate, the mean number of tokens committed per denoising step (all steps pooled) and the mean
number of steps per request. Each task's rows also carry its answer area and its first-step
confidence signature: how the confidences of the first block's masked positions are distributed
at a request's first step (pooled over its problems; the same for every threshold, since nothing
is committed before that step). The threshold controller reads the rows as its τ → tokens/step
and τ → accuracy priors, and the signatures as the risk profiles a request's own first step is
compared with.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass

from dilaserve_jax.core.cli import add_config_arguments, config_from_args, opt, returns_exit_status, setup_logging
from dilaserve_jax.core.kinds import CACHE_MODES, StepKind
from dilaserve_jax.tasks.prompts import prompt_hash
from dilaserve_jax.tasks.suite import SPLITS

log = logging.getLogger(__name__)
DEFAULT_THRESHOLDS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.6, 0.5, 0.3)
DECODERS = ("reference", "fast")


@dataclass(frozen=True, slots=True)
class EvalConfig:
    model: str = opt("tiny", "preset (tiny) or checkpoint directory")
    thresholds: tuple[float, ...] = opt(DEFAULT_THRESHOLDS, "confidence thresholds tau in (0, 1]", metavar="TAU")
    per_task: int = opt(50, "problems per task")
    tasks: tuple[str, ...] = opt((), "subset of tasks", metavar="TASK", default_text="all")
    block_length: int = opt(32, "semi-autoregressive block length")
    split: str = opt("heldout", "problem split", choices=SPLITS)
    seed: int = opt(0, "problem sampling seed")
    decoder: str = opt("reference", "reference = uncached one-forward-per-step sampler; fast = batched slot decoder",
                       choices=DECODERS)
    cache_mode: str = opt("dual", "KV cache of the fast decoder: none (exact), prefix, dual", name="--cache",
                          aliases=("--cache-mode",), choices=CACHE_MODES)

    def __post_init__(self):
        from dilaserve_jax.tasks.suite import SPLITS, TASKS

        if not self.thresholds or not all(0.0 < t <= 1.0 for t in self.thresholds):
            raise ValueError(f"thresholds must be in (0, 1], got {self.thresholds}")
        if self.per_task <= 0 or self.block_length <= 0:
            raise ValueError("per_task and block_length must be positive")
        unknown = set(self.tasks) - set(TASKS)
        if unknown:
            raise ValueError(f"unknown tasks {sorted(unknown)}; tasks: {', '.join(TASKS)}")
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}")
        if self.decoder not in DECODERS:
            raise ValueError(f"decoder must be one of {DECODERS}, got {self.decoder!r}")
        if self.cache_mode not in CACHE_MODES:
            raise ValueError(f"cache_mode must be one of {CACHE_MODES}, got {self.cache_mode!r}")


@dataclass(frozen=True, slots=True)
class Decoded:
    answer: list[int]  # tokens before the first EOS
    steps: int
    committed: int  # positions committed over all steps (EOS included)
    per_step: tuple[int, ...] = ()  # positions committed by each step, in order


def _reference_decoder(model, block_length: int, cache_mode: str):
    from dilaserve_jax.decoding.reference import generate

    def run(prompts, gen_length, tau, on_done):
        out = []
        for p in prompts:
            r = generate(model.graphdef, model.params, model.config, p, gen_length, block_length, tau)
            out.append(Decoded(r.answer, r.steps, sum(r.committed_per_step), tuple(r.committed_per_step)))
            on_done(1)
        return out

    return run


def _slot_decoder(model, block_length: int, cache_mode: str, num_slots: int = 16):
    """A SlotDecoder for the suite's prompts that compiles only the shapes a run uses."""
    try:
        from dilaserve_jax.core.kinds import CacheMode
        from dilaserve_jax.decoding.decoder import DecoderConfig, SlotDecoder
    except ImportError as err:
        raise ValueError(f"the fast decoding path is not available ({err}); use --decoder reference") from None
    from dilaserve_jax.tasks.suite import TASKS

    longest = max(t.max_prompt + t.gen_length for t in TASKS.values())
    lengths = tuple(sorted({min(64, model.config.max_len), min(-(-longest // 64) * 64, model.config.max_len)}))
    return SlotDecoder(model.config, model.graphdef, model.params,
                       DecoderConfig(num_slots, lengths, (block_length,), CacheMode(cache_mode)),
                       warm_up=False, progress=False)


def first_step_confidence(decoder, prompts, gen_length: int, block_length: int) -> list[float]:
    """Share of the first block's masked positions per confidence bin at a request's first step,
    pooled over the prompts (one refresh step each, batched over the decoder's slots)."""
    totals: list[int] = []
    for lo in range(0, len(prompts), decoder.num_slots):
        batch = prompts[lo:lo + decoder.num_slots]
        slots = list(range(len(batch)))
        for slot, p in zip(slots, batch):
            decoder.admit(slot, p, gen_length, block_length)
        for out in decoder.step(StepKind.REFRESH, slots, [1.0] * len(slots)):
            totals = [a + b for a, b in zip(totals, out.confidence_counts)] if totals else list(out.confidence_counts)
        for slot in slots:
            decoder.release(slot)
    n = sum(totals)
    return [round(c / n, 5) for c in totals] if n else []


def _fast_decoder(model, block_length: int, cache_mode: str, num_slots: int = 16):
    """Batched decoding on a SlotDecoder (KV-cached unless cache_mode is 'none')."""
    from dilaserve_jax.decoding.offline import DecodeRequest, generate_many

    decoder = _slot_decoder(model, block_length, cache_mode, num_slots)

    def run(prompts, gen_length, tau, on_done):
        reqs = [DecodeRequest(tuple(p), gen_length, block_length, tau) for p in prompts]
        results, _ = generate_many(decoder, reqs)
        on_done(len(prompts))
        return [Decoded(r.answer, r.steps, r.committed, tuple(r.per_step)) for r in results]

    return run


DECODER_FACTORIES = {"reference": _reference_decoder, "fast": _fast_decoder}


def evaluate(cfg: EvalConfig, model=None, progress: bool = True) -> list[dict]:
    """Rows {task, kind, threshold, accuracy, tokens_per_step, steps, n, answer_length, block_length,
    first_step_confidence, trajectories, valid, prompt_hash} for every task x threshold, then the
    summary rows. `trajectories[i]` lists the positions problem i committed at each step (in order),
    `valid[i]` whether its answer was graded valid, `prompt_hash[i]` identifies its prompt: the
    per-request, per-step distribution the simulator's modelled runner replays."""
    from tqdm import tqdm

    from dilaserve_jax.models import load_model
    from dilaserve_jax.tasks.graders import grade
    from dilaserve_jax.tasks.suite import TASKS, unique_problems

    model = model or load_model(cfg.model)
    run = DECODER_FACTORIES[cfg.decoder](model, cfg.block_length, cfg.cache_mode)
    probe = _slot_decoder(model, cfg.block_length, "dual")  # first steps: the serving path's refresh step
    names = cfg.tasks or tuple(TASKS)
    rows = []
    bar = tqdm(total=len(names) * len(cfg.thresholds) * cfg.per_task, desc="eval", unit="req",
               disable=not progress, file=sys.stderr, dynamic_ncols=True)
    for name in names:
        task, problems = TASKS[name], unique_problems(name, cfg.split, cfg.per_task, cfg.seed)
        prompts = [model.tokenizer.encode(p.prompt) for p in problems]
        signature = first_step_confidence(probe, prompts, task.gen_length, cfg.block_length)
        for tau in cfg.thresholds:
            bar.set_postfix(task=name, tau=tau)
            decoded = run(prompts, task.gen_length, tau, bar.update)
            valid = [int(grade(p, model.tokenizer.decode(d.answer))) for p, d in zip(problems, decoded)]
            steps = sum(d.steps for d in decoded)
            rows.append({"task": name, "kind": task.kind, "threshold": tau,
                         "accuracy": sum(valid) / len(problems),
                         "tokens_per_step": sum(d.committed for d in decoded) / max(steps, 1),
                         "steps": steps / len(problems), "n": len(problems),
                         "answer_length": task.gen_length, "block_length": min(cfg.block_length, task.gen_length),
                         "first_step_confidence": signature,
                         "trajectories": [list(d.per_step) for d in decoded], "valid": valid,
                         "prompt_hash": [prompt_hash(p) for p in prompts]})
    bar.close()
    return rows + summary_rows(rows)


def summary_rows(rows: list[dict]) -> list[dict]:
    """Unweighted means over all tasks and over each kind, per threshold (task 'mean:<group>')."""
    out = []
    for tau in dict.fromkeys(r["threshold"] for r in rows):
        at = [r for r in rows if r["threshold"] == tau]
        for group in ("all", *dict.fromkeys(r["kind"] for r in at)):
            sel = [r for r in at if group == "all" or r["kind"] == group]
            out.append({"task": f"mean:{group}", "kind": "summary", "threshold": tau,
                        **{k: sum(r[k] for r in sel) / len(sel) for k in ("accuracy", "tokens_per_step", "steps")},
                        "n": sum(r["n"] for r in sel)})
    return out


def format_table(rows: list[dict]) -> str:
    """One line per task: accuracy % / tokens per step / steps per request for each threshold."""
    taus = list(dict.fromkeys(r["threshold"] for r in rows))
    by = {(r["task"], r["threshold"]): r for r in rows}
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    width = max(len(t) for t in tasks) + 2
    head = "task".ljust(width) + "kind".ljust(15) + "".join(f"tau={t:<4g} acc tok/st steps".rjust(28) for t in taus)
    lines = [head, "-" * len(head)]
    for t in tasks:
        kind = by[(t, taus[0])]["kind"]
        cells = "".join(f"{100 * by[(t, u)]['accuracy']:6.1f}% {by[(t, u)]['tokens_per_step']:6.2f} "
                        f"{by[(t, u)]['steps']:6.1f}".rjust(28) for u in taus)
        lines.append(t.ljust(width) + kind.ljust(15) + cells)
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class EvalOutput:
    json: bool = opt(False, "print the rows as JSON instead of a table")
    progress: bool = opt(True, "progress bar on stderr")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dilaserve_jax.tasks.eval",
        description="Evaluate a model on held-out task problems at several confidence thresholds: valid-answer "
                    "rate, mean tokens committed per denoising step, and steps per request.")
    add_config_arguments(p, EvalConfig)
    return add_config_arguments(p, EvalOutput)


@returns_exit_status
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg, output = config_from_args(EvalConfig, args, parser), config_from_args(EvalOutput, args, parser)
    setup_logging(log)
    try:
        rows = evaluate(cfg, progress=output.progress)
    except (ValueError, FileNotFoundError) as err:
        log.error(f"error: {err}")
        return 2
    print(json.dumps(rows, indent=1) if output.json else format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
