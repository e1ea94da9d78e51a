"""`python -m dilaserve_jax.sim.synth_trace`: write a synthetic request trace CSV.

The simulator, `sim.calibrate` and the benchmarks read traces with the Azure LLM inference
columns (TIMESTAMP, ContextTokens, GeneratedTokens). The code trace in the repository has short
answers; this writes a trace of another shape, so that a decision can be checked on a workload it
was not tuned on. Prompt and answer lengths are log-normal around the given medians (clipped),
the gaps between arrivals gamma-distributed with the given mean and coefficient of variation
(1: Poisson; above 1: bursty). The defaults give a conversation-style mix: prompts around 1,020
tokens and answers around 129, as in published conversation traces.
"""
from __future__ import annotations

import argparse
import csv
import math
import random
import sys
from dataclasses import dataclass
from datetime import datetime, timedelta

from dilaserve_jax.core.cli import add_config_arguments, config_from_args, opt, returns_exit_status


@dataclass(frozen=True, slots=True)
class SynthConfig:
    out: str = opt("-", "CSV to write (- for stdout)", metavar="CSV")
    rows: int = opt(20_000, "requests in the trace")
    prompt_median: float = opt(1020.0, "median prompt length in tokens")
    prompt_sigma: float = opt(0.8, "log-normal sigma of the prompt length")
    prompt_max: int = opt(4000, "longest prompt (tokens)")
    answer_median: float = opt(129.0, "median answer length in tokens")
    answer_sigma: float = opt(0.9, "log-normal sigma of the answer length")
    answer_max: int = opt(1000, "longest answer (tokens)")
    mean_gap_s: float = opt(0.1, "mean seconds between arrivals")
    gap_cv: float = opt(2.0, "coefficient of variation of the gaps (1: Poisson)")
    seed: int = opt(7, "random seed")

    def __post_init__(self) -> None:
        if self.rows < 1 or self.prompt_max < 8 or self.answer_max < 1:
            raise ValueError("--rows must be >= 1, --prompt-max >= 8, --answer-max >= 1")
        if min(self.prompt_median, self.answer_median, self.mean_gap_s, self.gap_cv) <= 0:
            raise ValueError("medians, --mean-gap-s and --gap-cv must be positive")
        if min(self.prompt_sigma, self.answer_sigma) < 0:
            raise ValueError("sigmas must be >= 0")


def rows(cfg: SynthConfig):
    """(seconds since the start, prompt tokens, answer tokens) per request."""
    rng = random.Random(cfg.seed)
    shape = 1.0 / cfg.gap_cv ** 2
    t = 0.0
    for _ in range(cfg.rows):
        t += rng.gammavariate(shape, cfg.mean_gap_s / shape)
        prompt = int(min(cfg.prompt_max, max(8, math.exp(rng.gauss(math.log(cfg.prompt_median), cfg.prompt_sigma)))))
        answer = int(min(cfg.answer_max, max(1, math.exp(rng.gauss(math.log(cfg.answer_median), cfg.answer_sigma)))))
        yield t, prompt, answer


START = datetime(2023, 11, 16, 18, 0, 0)


def timestamp(seconds: float) -> str:
    """The trace's clock format, from 2023-11-16 18:00:00 on (the calendar rolls over past midnight)."""
    return (START + timedelta(seconds=seconds)).strftime("%Y-%m-%d %H:%M:%S.%f")


def write(cfg: SynthConfig, stream) -> int:
    w = csv.writer(stream)
    w.writerow(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
    n = 0
    for t, prompt, answer in rows(cfg):
        w.writerow([timestamp(t), prompt, answer])
        n += 1
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dilaserve_jax.sim.synth_trace", description=__doc__.split("\n\n")[1])
    return add_config_arguments(p, SynthConfig)


@returns_exit_status
def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    cfg = config_from_args(SynthConfig, p.parse_args(argv), p)
    if cfg.out == "-":
        write(cfg, sys.stdout)
    else:
        with open(cfg.out, "w", newline="") as f:
            n = write(cfg, f)
        print(f"wrote {n} requests to {cfg.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
