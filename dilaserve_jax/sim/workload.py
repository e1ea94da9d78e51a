"""Workloads: when requests arrive, what they ask for, and their SLOs (pure Python + numpy).

Arrivals (`--trace`):
  PATH                  an Azure LLM inference trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens), e.g.
                        the 2023 code trace (8,819 requests, 57 min; Patel et al., "Splitwise", ISCA 2024);
                        times are relative to the first request and divided by `--rate-scale`; a
                        `--duration` longer than the (sped-up) trace repeats it, each copy one mean gap
                        after the last, rows and lengths included (e.g. `--rate-scale 12 --duration 900`:
                        the code trace at ~31 req/s, bursts past 70, three times over in 15 minutes).
  poisson:RATE          Poisson arrivals at RATE req/s (times `--rate-scale`).
  bursty:RATE[:CV]      a renewal process with gamma inter-arrival gaps of mean 1/RATE and coefficient of
                        variation CV (default 4): clumps of arrivals and long silences, like the trace.
  diurnal:RATE[:PERIOD[:AMP]]  Poisson with rate RATE·(1 + AMP·sin(2πt/PERIOD)) (default period 600 s, AMP 0.8):
                        between RATE·(1 − AMP) and RATE·(1 + AMP), starting at RATE and rising; e.g.
                        `diurnal:55:1200:0.818` goes 55 → 100 (300 s) → 10 (900 s) → 55 req/s over 20 minutes.
  steps:R1@S1,R2@S2,... piecewise-constant Poisson: R1 req/s for S1 seconds, then R2 for S2, ... (rates times
                        `--rate-scale`); e.g. `steps:20@300,90@300,20@300`. `--duration` is optional (the
                        steps' total); a longer one repeats the pattern, a shorter one cuts it.

Request shapes:
  llada_8b (or any published-table model): a trace row's ContextTokens is the prompt (cut to leave room
    for the answer in `max_len`), its GeneratedTokens plus one EOS are the positions the request must
    commit before it finishes, and the answer area is that rounded up to whole blocks (at most
    `max_answer`). Synthetic arrivals draw (context, generated) pairs from `--lengths` (a trace CSV)
    or use fixed lengths.
  tiny: a held-out problem of a task of the suite (its prompt and answer area, as `bench.policies`
    builds them); with a trace, a row asking for at most 12 generated tokens becomes a short-answer
    task (sort, repeat: 12-token area), a longer one a phrase task (upper, altcase: 96 tokens).
SLOs (`--slo`): `idle:LO,HI` (default 2,6) = uniform(LO, HI) × the request's idle latency (alone, on an
  instance of the reference TP, at the static τ; as `bench.policies` measures it), or `fixed:SECONDS`.
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

SHORT_TASKS = ("sort", "repeat")
LONG_TASKS = ("upper", "altcase")


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One arrival of a workload (times in seconds from the start)."""

    arrival: float
    task: str
    prompt_tokens: tuple[int, ...]
    answer_length: int
    block_length: int
    finish_tokens: int | None = None  # positions to commit before the answer ends (None: the model's own)
    slo: float = math.inf
    problem: object = None  # the suite problem (tiny), for grading over the network


@dataclass(frozen=True, slots=True)
class Trace:
    times: np.ndarray  # seconds from the first request
    context: np.ndarray
    generated: np.ndarray
    source: str = ""

    def __len__(self) -> int:
        return len(self.times)


def load_trace(path: str | Path) -> Trace:
    """Read an Azure LLM inference trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace {path} not found (the Azure code trace lives in ../shared/traces/, "
                                "or pass any CSV with TIMESTAMP, ContextTokens, GeneratedTokens)")
    times, ctx, gen = [], [], []
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
        if not need <= set(reader.fieldnames or ()):
            raise ValueError(f"{path}: need columns {sorted(need)}, found {reader.fieldnames}")
        for i, row in enumerate(reader):
            try:
                times.append(_parse_time(row["TIMESTAMP"]))
                ctx.append(int(row["ContextTokens"]))
                gen.append(int(row["GeneratedTokens"]))
            except (ValueError, TypeError) as err:
                raise ValueError(f"{path}: bad row {i + 2}: {err}") from None
    if not times:
        raise ValueError(f"{path}: no requests")
    t = np.asarray(times, dtype=np.float64)
    order = np.argsort(t, kind="stable")
    t = t[order] - t[order][0]
    return Trace(t, np.asarray(ctx)[order], np.asarray(gen)[order], str(path))


def _parse_time(text: str) -> float:
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    head, _, frac = text.partition(".")
    base = datetime.strptime(head, "%Y-%m-%d %H:%M:%S").timestamp()
    return base + (float("0." + frac) if frac else 0.0)


# --- arrival processes ---
def arrival_times(spec: str, *, duration: float | None, rate_scale: float, rng: np.random.Generator,
                  trace: Trace | None = None) -> np.ndarray:
    """Arrival times (s) of `spec` (see module doc), within `duration` seconds when given."""
    if rate_scale <= 0:
        raise ValueError("--rate-scale must be positive")
    kind, _, args = spec.partition(":")
    if trace is not None and kind not in SYNTHETIC:
        t = trace.times / rate_scale
        if duration and len(t) > 1 and 0 < t[-1] < duration:  # repeat it, one mean gap between copies
            period = t[-1] * len(t) / (len(t) - 1)
            t = np.concatenate([t + k * period for k in range(int(duration // period) + 1)])
        return t[t < duration] if duration else t
    if kind == "steps":
        steps = parse_steps(spec)
        total = sum(s for _, s in steps)
        return _steps(steps, total if duration is None else duration, rate_scale, rng)
    if duration is None or duration <= 0:
        raise ValueError(f"synthetic arrivals ({spec}) need a positive --duration")
    vals = [float(x) for x in args.split(":") if x] if args else []
    if not vals or vals[0] <= 0:
        raise ValueError(f"{spec!r}: need a positive rate, e.g. {kind}:2.5")
    rate = vals[0] * rate_scale
    if kind == "poisson":
        return _renewal(lambda n: rng.exponential(1 / rate, n), duration)
    if kind == "bursty":
        cv = vals[1] if len(vals) > 1 else 4.0
        if cv <= 0:
            raise ValueError("bursty CV must be positive")
        shape = 1 / cv ** 2  # gamma with mean 1/rate and CV cv
        return _renewal(lambda n: rng.gamma(shape, 1 / (rate * shape), n), duration)
    if kind == "diurnal":
        period = vals[1] if len(vals) > 1 else 600.0
        amp = vals[2] if len(vals) > 2 else 0.8
        if period <= 0 or not 0 <= amp <= 1:
            raise ValueError("diurnal needs PERIOD > 0 and 0 <= AMP <= 1")
        peak = rate * (1 + amp)
        cand = _renewal(lambda n: rng.exponential(1 / peak, n), duration)
        keep = rng.random(len(cand)) < (1 + amp * np.sin(2 * np.pi * cand / period)) / (1 + amp)
        return cand[keep]
    raise ValueError(f"unknown arrival spec {spec!r}: a trace CSV path, poisson:RATE, bursty:RATE[:CV], "
                     "diurnal:RATE[:PERIOD[:AMP]] or steps:RATE@SECONDS,...")


def parse_steps(spec: str) -> list[tuple[float, float]]:
    """`steps:R1@S1,R2@S2,...` -> [(rate, seconds), ...] (rate >= 0, seconds > 0, at least one step)."""
    kind, _, args = spec.partition(":")
    usage = f"bad arrival spec {spec!r}: need steps:RATE@SECONDS,RATE@SECONDS,... e.g. steps:20@300,90@300,20@300"
    if kind != "steps" or not args.strip():
        raise ValueError(usage)
    out = []
    for part in args.split(","):
        rate, at, seconds = part.strip().partition("@")
        try:
            r, s = float(rate), float(seconds)
        except ValueError:
            raise ValueError(f"{usage} (step {part!r} is not RATE@SECONDS)") from None
        if not at or not (r >= 0 and math.isfinite(r)) or not (s > 0 and math.isfinite(s)):
            raise ValueError(f"{usage} (step {part!r}: rate must be >= 0 and seconds > 0)")
        out.append((r, s))
    if not any(r > 0 for r, _ in out):
        raise ValueError(f"{usage} (every rate is 0)")
    return out


def step_rate(steps: Sequence[tuple[float, float]], t: float) -> float:
    """The rate of a steps pattern at time t (the pattern repeats after its total)."""
    total = sum(s for _, s in steps)
    t = t % total
    for rate, seconds in steps:
        if t < seconds:
            return rate
        t -= seconds
    return steps[-1][0]


def _steps(steps: Sequence[tuple[float, float]], duration: float, rate_scale: float,
           rng: np.random.Generator) -> np.ndarray:
    if duration <= 0:
        raise ValueError("steps arrivals need a positive --duration (or none: the steps' total)")
    out, start, i = [], 0.0, 0
    while start < duration:
        rate, seconds = steps[i % len(steps)]
        end = min(start + seconds, duration)
        if rate > 0:
            t = _renewal(lambda n: rng.exponential(1 / (rate * rate_scale), n), end - start)
            out.append(t + start)
        start, i = end, i + 1
    return np.concatenate(out) if out else np.zeros(0)


def _renewal(gaps: Callable[[int], np.ndarray], duration: float) -> np.ndarray:
    out, t = [], 0.0
    while True:
        g = np.cumsum(gaps(1024)) + t
        out.append(g[g < duration])
        if g[-1] >= duration:
            return np.concatenate(out)
        t = float(g[-1])


SYNTHETIC = ("poisson", "bursty", "diurnal", "steps")


def is_synthetic(spec: str) -> bool:
    return spec.split(":", 1)[0] in SYNTHETIC


# --- request shapes ---
@dataclass(frozen=True, slots=True)
class Shape:
    task: str
    prompt_len: int
    answer_length: int
    block_length: int
    finish_tokens: int | None
    prompt_tokens: tuple[int, ...] | None = None
    problem: object = None


def llada_shape(context: int, generated: int, *, max_len: int = 4096, block: int = 32,
                max_answer: int = 1024, task: str = "gsm8k") -> Shape:
    """A trace row as an LLaDA request (see module doc)."""
    finish = max(1, min(int(generated) + 1, max_answer))
    area = min(max_answer, -(-finish // block) * block)
    prompt = max(1, min(int(context), max_len - area))
    return Shape(task, prompt, area, block, finish)


class TinyShapes:
    """Held-out problems of the embedded model's task suite (prompts as the tiny tokenizer encodes them)."""

    def __init__(self, per_task: int = 6, seed: int = 0, tasks: Sequence[str] | None = None) -> None:
        from dilaserve_jax.tasks.suite import TASKS, task_block, unique_problems

        names = tuple(tasks or TASKS)
        self.pool: dict[str, list[Shape]] = {}
        for name in names:
            t = TASKS[name]
            self.pool[name] = [Shape(name, len(p.prompt), t.gen_length, task_block(t.gen_length), None,
                                     tuple(ord(c) for c in p.prompt), p)
                               for p in unique_problems(name, "heldout", per_task, seed)]

    def draw(self, rng: np.random.Generator, generated: int | None = None) -> Shape:
        names = list(self.pool)
        if generated is not None:
            group = [n for n in (SHORT_TASKS if generated <= 12 else LONG_TASKS) if n in self.pool]
            names = group or names
        pool = self.pool[names[int(rng.integers(len(names)))]]
        return pool[int(rng.integers(len(pool)))]


def build_shapes(model: str, n: int, rng: np.random.Generator, *, trace: Trace | None, from_trace_rows: bool,
                 fixed: tuple[int, int] = (512, 256), max_len: int = 4096, max_answer: int = 1024,
                 tiny: TinyShapes | None = None) -> list[Shape]:
    """`n` request shapes: the trace's own rows in order (`from_trace_rows`; a repeated trace starts
    over), rows drawn from the trace
    (synthetic arrivals with `--lengths`), or fixed lengths."""
    if model == "tiny":
        tiny = tiny or TinyShapes()
        if trace is not None:
            rows = (i % len(trace) for i in range(n)) if from_trace_rows else rng.integers(len(trace), size=n)
            return [tiny.draw(rng, int(trace.generated[i])) for i in rows]
        return [tiny.draw(rng) for _ in range(n)]
    if trace is not None:
        rows = np.arange(n) % len(trace) if from_trace_rows else rng.integers(len(trace), size=n)
        return [llada_shape(int(trace.context[i]), int(trace.generated[i]), max_len=max_len, max_answer=max_answer)
                for i in rows]
    return [llada_shape(fixed[0], fixed[1] - 1, max_len=max_len, max_answer=max_answer)] * n


def parse_slo(spec: str) -> tuple[str, tuple[float, ...]]:
    kind, _, args = spec.partition(":")
    try:
        vals = tuple(float(x) for x in args.replace(",", ":").split(":") if x)
    except ValueError:
        raise ValueError(f"bad --slo {spec!r}") from None
    if kind == "idle" and len(vals) in (0, 2) and (not vals or 0 < vals[0] <= vals[1]):
        return kind, vals or (2.0, 6.0)
    if kind == "fixed" and len(vals) == 1 and vals[0] > 0:
        return kind, vals
    raise ValueError(f"--slo must be idle:LO,HI (0 < LO <= HI) or fixed:SECONDS, got {spec!r}")
