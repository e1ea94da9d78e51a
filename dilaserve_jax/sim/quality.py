"""What a modelled request commits per step and whether its answer is valid (pure Python + numpy).

Two sources, one interface (`QualityModel`):

- **Measured** (`from_eval_rows`): the rows of `python -m dilaserve_jax.tasks.eval --json` carry, per
  task and τ, each held-out problem's commit trajectory (positions committed at every step) and
  whether its answer was valid. A modelled request of a task replays one problem's trajectories
  (drawn per request: hard prompts stay hard at every τ), so the per-request spread and the
  per-step pattern (e.g. 31 positions, then 1) are the measured ones, not a mean. Between two
  grid values of τ a step follows one of the two neighbouring trajectories, chosen at random with
  weights by distance (so expectations interpolate). When τ changes mid-block the request carries
  on along the new τ's cumulative curve from the number of positions it has committed.
  Validity: the problem's measured validity at each τ, weighted by the positions the request
  committed at that τ, is the probability its answer is valid.
- **Published** (`from_table`): models we cannot run here (LLaDA-8B) come with a τ → (tokens per
  step, accuracy) table taken from a paper (see `LLADA_8B_GSM8K`). A request's answer ends where
  its workload says (e.g. the trace's generated tokens plus EOS); each block takes
  ceil(tokens / rate) steps at a rate drawn around the table's mean with a per-request and a
  per-block log-normal factor, and commits evenly over them. Validity: the table's accuracy at the
  τ of each committed position, averaged.

Accuracy budget: the simulator runs the serving code's budget unchanged
(`ThresholdConfig.from_eval` over `eval_rows()`: the measured rows themselves, or the published
table written as eval rows). Its evidence is a request's first-step confidence histogram; a
modelled request reports one at its first step, drawn from its task's measured first-step
signature (multinomial over the block's positions), and none at later steps, so the budget
charges every later step below τ_max as one that changed commits (the serving code's rule for a
step without a histogram: conservative). A published table has no signature: no evidence.

Each request's randomness derives from (model seed, request key) only, so a request that moves
between instances continues exactly as it would have in place.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from dilaserve_jax.tasks.prompts import prompt_hash

# LLaDA-8B on GSM8K (5-shot), generation length 256, block 32, from Fast-dLLM: C. Wu et al.,
# "Fast-dLLM: Training-free Acceleration of Diffusion LLM by Enabling KV Cache and Parallel
# Decoding", arXiv:2505.22618, Table 1 (LLaDA rows): one token per step (the baseline, τ = 1.0)
# 79.3 % at 6.7 tokens/s; confidence-aware parallel decoding at threshold 0.9 without cache 79.2 %
# at 16.5 tokens/s. Tokens per step at τ 0.9 is the throughput ratio 16.5 / 6.7 (without a cache
# every step costs the same full forward, so tokens/s is proportional to tokens per step).
# Only τ 1.0 and 0.9 are published as numbers; below 0.9 the table is extended linearly through
# those two points (`extrapolated_below`), an assumption the simulator's report flags.
LLADA_8B_GSM8K = {
    "model": "LLaDA-8B",
    "task": "gsm8k",
    "source": "Fast-dLLM (Wu et al., arXiv:2505.22618), Table 1, LLaDA GSM8K 5-shot, length 256",
    "points": [  # τ, tokens per step, accuracy
        [1.0, 1.0, 0.793],
        [0.9, 16.5 / 6.7, 0.792],
    ],
    "extrapolated_below": 0.9,
    "grid": [1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.6, 0.5, 0.4, 0.3],
    "block_sigma": 0.25,  # per-block log-normal spread of the rate (assumed; see docs/simulation.md)
    "request_sigma": 0.25,  # per-request log-normal spread of the rate (assumed)
    "n": 1319,  # GSM8K test problems (Cobbe et al., arXiv:2110.14168), the set the table was measured on
    "answer_length": 256,
}
PUBLISHED = {"llada_8b": LLADA_8B_GSM8K}


@dataclass(frozen=True, slots=True)
class Template:
    """One measured problem: per τ (grid order), its per-block cumulative commits and validity."""

    task: str
    blocks: tuple[tuple[tuple[int, ...], ...], ...]  # [τ][block] -> cumulative positions after each step
    valid: tuple[int, ...]  # [τ]
    prompt: str = ""  # `tasks.prompts.prompt_hash` of the measured prompt


@dataclass(slots=True)
class Progress:
    """A slot's progress through its request (block index, positions committed in the block)."""

    block: int = 0
    in_block: int = 0
    committed: int = 0
    steps: int = 0


def _blocks_of(trajectory: Sequence[int], block_length: int) -> tuple[tuple[int, ...], ...]:
    """Split a commit trajectory into blocks (commits never cross a block boundary), cumulative."""
    out: list[tuple[int, ...]] = []
    cur: list[int] = []
    total = 0
    for n in trajectory:
        total += int(n)
        cur.append(total)
        if total >= block_length:
            out.append(tuple(cur))
            cur, total = [], 0
    if cur:
        out.append(tuple(cur))
    return tuple(out)


class QualityModel:
    """Per task: how a request commits tokens at τ, and the probability its answer is valid."""

    def __init__(self, *, name: str, grid: Sequence[float], templates: Mapping[str, Sequence[Template]] | None = None,
                 table: Mapping | None = None, seed: int = 0, source: str = "") -> None:
        self.name, self.seed, self.source = name, int(seed), source
        self.grid = tuple(sorted(float(t) for t in grid))  # ascending
        if len(set(self.grid)) != len(self.grid) or not all(0 < t <= 1 for t in self.grid):
            raise ValueError(f"τ grid must be distinct values in (0, 1]: {grid}")
        self.templates = {k: list(v) for k, v in (templates or {}).items()}
        self.by_prompt = {(t.task, t.prompt): t for pool in self.templates.values() for t in pool if t.prompt}
        self.match_prompts = True  # a request whose prompt was measured replays its own trajectories
        self.table = dict(table) if table is not None else None
        self.signatures: dict[str, tuple[float, ...]] = {}  # task -> first-step confidence shares per bin
        self.rows: list[dict] = []  # the eval rows it was built from (measured)
        if not self.templates and self.table is None:
            raise ValueError("a quality model needs measured templates or a published table")
        if self.table is not None:
            pts = sorted((float(t), float(r), float(a)) for t, r, a in self.table["points"])
            self._tab_tau = [p[0] for p in pts]
            self._tab_rate = [p[1] for p in pts]
            self._tab_acc = [p[2] for p in pts]
            self.extrapolated_below = float(self.table.get("extrapolated_below", pts[0][0]))
            self.block_sigma = float(self.table.get("block_sigma", 0.0))
            self.request_sigma = float(self.table.get("request_sigma", 0.0))
        else:
            self.extrapolated_below = 0.0

    # --- construction ---
    @classmethod
    def from_eval_rows(cls, rows: str | Path | Iterable[Mapping], seed: int = 0) -> "QualityModel":
        """From `tasks.eval --json` rows with per-problem `trajectories` and `valid` (see module doc)."""
        source = ""
        if isinstance(rows, (str, Path)):
            source = str(rows)
            rows = json.loads(Path(rows).read_text())
        per_task = [dict(r) for r in rows if r.get("kind") != "summary"]
        if not per_task:
            raise ValueError("no per-task eval rows")
        missing = [r["task"] for r in per_task if "trajectories" not in r or "valid" not in r]
        if missing:
            raise ValueError(f"eval rows lack per-problem trajectories for {sorted(set(missing))}: regenerate them "
                             "with `python -m dilaserve_jax.tasks.eval --json` (the simulator replays them)")
        grid = sorted({float(r["threshold"]) for r in per_task})
        templates: dict[str, list[Template]] = {}
        for task in dict.fromkeys(r["task"] for r in per_task):
            by_tau = {float(r["threshold"]): r for r in per_task if r["task"] == task}
            if sorted(by_tau) != grid:
                raise ValueError(f"task {task} lacks some τ of the grid {grid}")
            n = {len(r["trajectories"]) for r in by_tau.values()}
            if len(n) != 1:
                raise ValueError(f"task {task}: a different number of problems per τ")
            block = int(by_tau[grid[0]].get("block_length", 32))
            hashes = by_tau[grid[0]].get("prompt_hash") or [""] * len(by_tau[grid[0]]["trajectories"])
            templates[task] = [
                Template(task, tuple(_blocks_of(by_tau[t]["trajectories"][i], block) for t in grid),
                         tuple(int(by_tau[t]["valid"][i]) for t in grid), hashes[i])
                for i in range(n.pop())]
        model = cls(name="measured", grid=grid, templates=templates, seed=seed, source=source)
        model.signatures = {r["task"]: tuple(float(x) for x in r["first_step_confidence"])
                            for r in per_task if r.get("first_step_confidence")}
        model.rows = [dict(r) for r in rows]
        return model

    @classmethod
    def from_table(cls, table: Mapping | str, seed: int = 0) -> "QualityModel":
        """A published table (`PUBLISHED` name, or a dict with `points` [[τ, tokens/step, accuracy]])."""
        if isinstance(table, str):
            try:
                table = PUBLISHED[table]
            except KeyError:
                raise ValueError(f"no published table {table!r}; known: {', '.join(PUBLISHED)}") from None
        if not table.get("points"):
            raise ValueError("a published table needs points [[τ, tokens/step, accuracy], ...]")
        grid = table.get("grid") or [p[0] for p in table["points"]]
        return cls(name=str(table.get("model", "published")), grid=grid, table=table, seed=seed,
                   source=str(table.get("source", "")))

    # --- per-request randomness: stateless draws keyed by (model seed, request key, what, index) ---
    def uniform(self, key: int, *salt: int) -> float:
        return uniform(self.seed, key, *salt)

    def normal(self, key: int, *salt: int) -> float:
        u1, u2 = self.uniform(key, *salt, 0), self.uniform(key, *salt, 1)
        return math.sqrt(-2.0 * math.log(max(u1, 1e-300))) * math.cos(2.0 * math.pi * u2)

    def template(self, task: str, key: int, prompt_tokens: Sequence[int] | None = None) -> Template | None:
        """The measured problem a request of `task` replays: its own when its prompt was measured (and
        `match_prompts`), else one drawn from the task's (None for a published table)."""
        if not self.templates:
            return None
        if prompt_tokens is not None and self.match_prompts and self.by_prompt:
            own = self.by_prompt.get((task, prompt_hash(prompt_tokens)))
            if own is not None:
                return own
        try:
            pool = self.templates[task]
        except KeyError:
            raise ValueError(f"no measured trajectories for task {task!r}; have {sorted(self.templates)}") from None
        return pool[min(len(pool) - 1, int(self.uniform(key, 1) * len(pool)))]

    @property
    def tasks(self) -> tuple[str, ...]:
        return tuple(self.templates) if self.templates else (str(self.table.get("task", "task")),)

    def eval_rows(self) -> list[dict]:
        """Rows in the format of `python -m dilaserve_jax.tasks.eval --json`, for the serving code's
        `ThresholdConfig.from_eval`: the measured rows, or the published table's points on its grid
        (accuracy and tokens per step as `table_accuracy`/`table_rate`, so extrapolated alike)."""
        if self.table is None:
            return [dict(r) for r in self.rows]
        task, n = self.tasks[0], int(self.table.get("n", 1))
        length = int(self.table.get("answer_length", 256))
        return [{"task": task, "kind": "published", "threshold": t, "accuracy": self.table_accuracy(t),
                 "tokens_per_step": self.table_rate(t), "steps": length / self.table_rate(t), "n": n,
                 "answer_length": length} for t in sorted(self.grid, reverse=True)]

    def first_step_counts(self, task: str, key: int, positions: int) -> tuple[int, ...]:
        """A request's first-step confidence histogram: `positions` masked positions spread over its
        task's measured signature (a multinomial draw fixed by the key); () without a signature."""
        sig = self.signatures.get(task)
        if not sig or positions <= 0:
            return ()
        cum, total = [], 0.0
        for share in sig:
            total += share
            cum.append(total)
        counts = [0] * len(sig)
        for i in range(positions):
            u = self.uniform(key, 9, i) * total
            counts[min(len(sig) - 1, bisect.bisect_right(cum, u))] += 1
        return tuple(counts)

    # --- the table ---
    def table_rate(self, tau: float) -> float:
        return max(1.0, _lin(tau, self._tab_tau, self._tab_rate))

    def table_accuracy(self, tau: float) -> float:
        return min(1.0, max(0.0, _lin(tau, self._tab_tau, self._tab_acc)))

    def accuracy(self, task: str, tau: float) -> float:
        """Mean validity at a constant τ (table, or the measured problems' mean), interpolated."""
        if self.table is not None:
            return self.table_accuracy(tau)
        pool = self.templates[task]
        vals = [sum(t.valid[k] for t in pool) / len(pool) for k in range(len(self.grid))]
        return _lin(tau, list(self.grid), vals, clamp=True)

    def tokens_per_step(self, task: str, tau: float) -> float:
        """Mean positions per step at a constant τ (for priors and reports)."""
        if self.table is not None:
            return self.table_rate(tau)
        pool = self.templates[task]
        vals = []
        for k in range(len(self.grid)):
            steps = sum(len(b) for t in pool for b in t.blocks[k])
            pos = sum(b[-1] for t in pool for b in t.blocks[k])
            vals.append(pos / max(1, steps))
        return _lin(tau, list(self.grid), vals, clamp=True)

    # --- one step ---
    def commit(self, plan: "RequestPlan", prog: Progress, tau: float) -> tuple[int, bool, bool]:
        """Positions committed by one step at τ; (n, block finished, request finished)."""
        if plan.template is not None:
            return self._commit_measured(plan, prog, tau)
        return self._commit_table(plan, prog, tau)

    def _grid_index(self, tau: float, u: float) -> int:
        g = self.grid
        i = bisect.bisect_left(g, tau - 1e-12)
        if i < len(g) and abs(g[i] - tau) <= 1e-9:
            return i
        if i == 0:
            return 0
        if i == len(g):
            return len(g) - 1
        lo, hi = g[i - 1], g[i]
        return i if u < (tau - lo) / (hi - lo) else i - 1

    def _commit_measured(self, plan: "RequestPlan", prog: Progress, tau: float) -> tuple[int, bool, bool]:
        blocks = plan.template.blocks[self._grid_index(tau, self.uniform(plan.key, 4, prog.steps))]
        if prog.block >= len(blocks):  # this τ's answer ended earlier: finish with this step
            return 1, True, True
        curve = blocks[prog.block]
        target = next((c for c in curve if c > prog.in_block), curve[-1])
        n = max(1, target - prog.in_block)
        last = prog.block == len(blocks) - 1
        done_block = prog.in_block + n >= curve[-1]
        return n, done_block or prog.in_block + n >= plan.block_length, last and done_block

    def _commit_table(self, plan: "RequestPlan", prog: Progress, tau: float) -> tuple[int, bool, bool]:
        size = plan.block_tokens(prog.block)
        rate = self.table_rate(tau) * plan.rate_factor(self, prog.block)
        steps = max(1, min(size, math.ceil(size / rate)))
        # even split over `steps`: the cumulative after step s is round(s * size / steps); carry on
        # from the positions already committed (τ may have changed mid-block)
        s = next(s for s in range(1, steps + 1) if round(s * size / steps) > prog.in_block)
        n = max(1, round(s * size / steps) - prog.in_block)
        done_block = prog.in_block + n >= size
        return n, done_block, done_block and prog.block == plan.last_block

    # --- validity ---
    def valid_probability(self, plan: "RequestPlan", steps: Sequence[tuple[float, int]]) -> float:
        """P(valid answer) after running `steps` ((τ, positions committed) in order)."""
        total = sum(n for _, n in steps)
        if total <= 0:
            return 0.0
        acc = 0.0
        for tau, n in steps:
            if plan.template is not None:
                acc += n * _lin(tau, list(self.grid), [float(v) for v in plan.template.valid], clamp=True)
            else:
                acc += n * self.table_accuracy(tau)
        return acc / total


@dataclass(slots=True)
class RequestPlan:
    """What the modelled runner needs to know of a request beyond the Runner contract."""

    key: int  # the request's randomness key (the runner receives it as the admission seed)
    task: str
    answer_length: int
    block_length: int
    template: Template | None = None
    finish_tokens: int | None = None  # table mode: positions up to and including the EOS
    request_factor: float = 1.0
    block_sigma: float = 0.0
    first_counts: tuple[int, ...] = ()  # its first step's confidence histogram (the budget's evidence)
    _block_factors: dict[int, float] = field(default_factory=dict)

    @property
    def last_block(self) -> int:
        tokens = self.finish_tokens or self.answer_length
        return (tokens - 1) // self.block_length

    def block_tokens(self, block: int) -> int:
        tokens = self.finish_tokens or self.answer_length
        return max(1, min(self.block_length, tokens - block * self.block_length))

    def rate_factor(self, model: QualityModel, block: int) -> float:
        """The request's rate multiplier in `block` (its own factor times a per-block one)."""
        f = self._block_factors.get(block)
        if f is None:
            z = model.normal(self.key, 7, block)
            f = self.request_factor * math.exp(self.block_sigma * z - self.block_sigma ** 2 / 2)
            self._block_factors[block] = f
        return f


def make_plan(model: QualityModel, key: int, task: str, answer_length: int, block_length: int,
              finish_tokens: int | None = None, prompt_tokens: Sequence[int] | None = None) -> RequestPlan:
    """The plan of one request: its measured problem (its own, or drawn from `key`) or its table rates."""
    template = model.template(task, key, prompt_tokens)
    first = model.first_step_counts(task, key, min(block_length, answer_length))
    if template is not None:
        return RequestPlan(key, task, answer_length, block_length, template, first_counts=first)
    z = model.normal(key, 2)
    factor = math.exp(model.request_sigma * z - model.request_sigma ** 2 / 2)
    if finish_tokens is not None and not 1 <= finish_tokens <= answer_length:
        raise ValueError(f"finish_tokens {finish_tokens} outside the answer area {answer_length}")
    return RequestPlan(key, task, answer_length, block_length, None, finish_tokens, factor, model.block_sigma, first)


def uniform(*ints: int) -> float:
    """A uniform draw in [0, 1) fixed by the integers (a hash: no generator state to carry around)."""
    digest = hashlib.blake2b(struct.pack(f"<{len(ints)}q", *(int(i) & 0x7FFFFFFFFFFFFFFF for i in ints)),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0 ** 64


def _lin(x: float, xs: Sequence[float], ys: Sequence[float], clamp: bool = False) -> float:
    """Piecewise-linear through (xs ascending, ys); beyond both ends extended linearly, or held
    flat with `clamp`."""
    if len(xs) == 1:
        return ys[0]
    if clamp:
        x = min(max(x, xs[0]), xs[-1])
    if x <= xs[0]:
        i = 0
    elif x >= xs[-1]:
        i = len(xs) - 2
    else:
        i = bisect.bisect_right(xs, x) - 1
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
