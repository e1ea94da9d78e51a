"""Step-latency model: predicts one batched step's seconds from (kind, batch, canvas, block, TP).

Fitted per (kind, TP degree) by non-negative least squares on physically motivated features, so
that a refresh step (queries = whole canvas) grows with canvas length (linear layers) and its
square (attention), while a reuse step (queries = one block) grows mostly with block size and the
cached keys it reads:

  refresh: a + b*B*L + c*B*L^2
  reuse:   a + b*B*K + c*B*L + d*B*K*L

Rows are weighted by 1/seconds (we care about relative error: times span orders of magnitude) and
coefficients are kept non-negative (a negative one would predict nonsense outside the grid).

A *measured* profile also answers from its points (`MeasuredSteps`): the profiler times exactly the
shapes the decoder compiles (its batch, length and block buckets), so a query is padded up to the
next measured batch, canvas and block, as the decoder pads it, and read from the table. The fit
answers beyond the grid, for a cell the profile lacks, and for analytic profiles (smooth by
construction). On a CPU the fit is far off (batch 2 costs 4x batch 1 on the tiny model's refresh,
where the fit is linear in the batch), and the scheduler's batching decisions follow the table.

`round_seconds` is what serving `batch` requests one step each costs when the batch may be split
into smaller ones run back to back (the cheapest split); `best_batch` is the size of that split.

Profile JSON (written by the profiler or `roofline.analytic_profile`):
  {"label": str, "analytic": bool, "device": str, "model": str,
   "points": [{"kind": "refresh"|"reuse", "batch": int, "canvas": int, "block": int, "tp": int,
               "seconds": float}, ...]}
"""
from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np
from scipy.optimize import nnls

from dilaserve_jax.core.kinds import StepKind

@dataclass(frozen=True, slots=True)
class ProfilePoint:
    kind: StepKind
    batch: int
    canvas: int
    block: int
    tp: int
    seconds: float

    def __post_init__(self) -> None:
        if self.batch < 1 or self.canvas < 1 or self.block < 1 or self.tp < 1:
            raise ValueError(f"bad profile point {self}")
        if not (self.seconds > 0 and np.isfinite(self.seconds)):
            raise ValueError(f"profile point needs positive finite seconds: {self}")

    @classmethod
    def from_json(cls, d: Mapping) -> "ProfilePoint":
        kind = StepKind.parse(d["kind"]) if isinstance(d["kind"], str) else StepKind(d["kind"])
        return cls(kind, int(d["batch"]), int(d["canvas"]), int(d["block"]), int(d.get("tp", 1)), float(d["seconds"]))

    def to_json(self) -> dict:
        return {"kind": self.kind.label, "batch": self.batch, "canvas": self.canvas,
                "block": self.block, "tp": self.tp, "seconds": self.seconds}


@dataclass(frozen=True, slots=True)
class Profile:
    label: str
    analytic: bool
    device: str
    model: str
    points: tuple[ProfilePoint, ...]

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("profile has no points")

    @classmethod
    def from_json(cls, d: Mapping) -> "Profile":
        return cls(str(d["label"]), bool(d["analytic"]), str(d["device"]), str(d["model"]),
                   tuple(ProfilePoint.from_json(p) for p in d["points"]))

    def to_json(self) -> dict:
        return {"label": self.label, "analytic": self.analytic, "device": self.device,
                "model": self.model, "points": [p.to_json() for p in self.points]}

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        return cls.from_json(json.loads(Path(path).read_text()))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))


@dataclass(frozen=True, slots=True)
class MeasuredSteps:
    """The measured seconds of one (kind, TP degree) on its grid of padded shapes."""

    batches: tuple[int, ...]
    canvases: tuple[int, ...]
    blocks: tuple[int, ...]
    seconds: Mapping[tuple[int, int, int], float]

    @classmethod
    def of(cls, points: Iterable[ProfilePoint]) -> "MeasuredSteps":
        pts = list(points)
        return cls(tuple(sorted({p.batch for p in pts})), tuple(sorted({p.canvas for p in pts})),
                   tuple(sorted({p.block for p in pts})), {(p.batch, p.canvas, p.block): p.seconds for p in pts})

    def lookup(self, batch: int, canvas: int, block: int) -> float | None:
        """Seconds at the shape padded up to the grid, or None beyond it or for an unmeasured cell."""
        padded = []
        for x, grid in ((batch, self.batches), (canvas, self.canvases), (block, self.blocks)):
            i = bisect.bisect_left(grid, x)
            if i == len(grid):
                return None
            padded.append(grid[i])
        return self.seconds.get(tuple(padded))


def features(kind: StepKind, batch, canvas, block) -> np.ndarray:
    """Feature matrix [n, f] (broadcasts scalars or arrays)."""
    b, l, k = (np.asarray(x, dtype=np.float64) for x in (batch, canvas, block))
    b, l, k = np.broadcast_arrays(b, l, k)
    one = np.ones_like(b)
    if kind == StepKind.REFRESH:
        cols = (one, b * l, b * l * l)
    else:
        cols = (one, b * k, b * l, b * k * l)
    return np.stack(cols, axis=-1)


def _nonneg_weighted_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Relative-error least squares with coefficients >= 0: non-negative least squares on rows
    scaled by 1/y (the square root of the 1/y^2 weight), so each residual counts relative to its
    point's seconds."""
    col_max = np.maximum(x.max(axis=0), 1e-30)  # column scaling keeps the solve well conditioned
    w = 1.0 / y
    coef, _ = nnls((x / col_max) * w[:, None], y * w)
    return coef / col_max


@dataclass(frozen=True, slots=True)
class FitReport:
    """Held-out relative error |pred - true| / true, per kind, of a model fitted on the rest."""

    n_train: int
    n_holdout: int
    mean_rel_error: dict[str, float]
    max_rel_error: dict[str, float]

    def __str__(self) -> str:
        parts = [f"{k}: mean {self.mean_rel_error[k]:.1%} max {self.max_rel_error[k]:.1%}" for k in self.mean_rel_error]
        return f"held-out {self.n_holdout}/{self.n_train + self.n_holdout} points; " + "; ".join(parts)


@dataclass(frozen=True, slots=True)
class LatencyModel:
    """coefs[(kind, tp)] -> feature coefficients; measured[(kind, tp)] -> the measured grid, read
    first where it covers the shape. `scale` multiplies every prediction."""

    coefs: Mapping[tuple[StepKind, int], tuple[float, ...]]
    label: str = ""
    analytic: bool = False
    scale: float = 1.0
    report: FitReport | None = field(default=None, compare=False)
    measured: Mapping[tuple[StepKind, int], MeasuredSteps] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.coefs:
            raise ValueError("latency model has no coefficients")
        if self.scale <= 0:
            raise ValueError("scale must be positive")

    @property
    def tp_degrees(self) -> tuple[int, ...]:
        return tuple(sorted({tp for _, tp in self.coefs}))

    def predict(self, kind: StepKind, batch: int, canvas_len: int, block_len: int, tp: int = 1) -> float:
        if batch <= 0:
            return 0.0
        try:
            c = self.coefs[(StepKind(kind), tp)]
        except KeyError:
            raise KeyError(f"no {StepKind(kind).name} fit for TP {tp}; profile has TP {self.tp_degrees}") from None
        grid = self.measured.get((StepKind(kind), tp))
        if grid is not None:
            t = grid.lookup(batch, canvas_len, block_len)
            if t is not None:
                return self.scale * t
        b, l, k = float(batch), float(canvas_len), float(block_len)  # plain floats: called per request per step
        f = (1.0, b * l, b * l * l) if kind == StepKind.REFRESH else (1.0, b * k, b * l, b * k * l)
        return self.scale * sum(ci * fi for ci, fi in zip(c, f))

    def predict_many(self, kind: StepKind, batch, canvas, block, tp: int = 1) -> np.ndarray:
        if (StepKind(kind), tp) in self.measured:
            return _elementwise(lambda *a: self.predict(kind, *a, tp), batch, canvas, block)
        c = np.asarray(self.coefs[(StepKind(kind), tp)])
        return self.scale * (features(kind, batch, canvas, block) @ c)

    def _split_costs(self, kind: StepKind, batch: int, canvas_len: int, block_len: int, tp: int) -> dict[int, float]:
        """Seconds to step `batch` requests once each in batches of each measured size k (ceil(batch/k)
        of them back to back), and as one batch."""
        grid = self.measured[(StepKind(kind), tp)]
        sizes = [*(k for k in grid.batches if k < batch), batch]
        return {k: math.ceil(batch / k) * self.predict(kind, k, canvas_len, block_len, tp) for k in sizes}

    def round_seconds(self, kind: StepKind, batch: int, canvas_len: int, block_len: int, tp: int = 1) -> float:
        """Seconds to give `batch` requests one step each, split into the cheapest batches of a
        measured size (run back to back). Only a measured grid can make a split cheaper: the fit's
        cost per request falls with the batch."""
        if batch <= 0:
            return 0.0
        if (StepKind(kind), tp) not in self.measured:  # the fit alone: one batch is always cheapest
            return self.predict(kind, batch, canvas_len, block_len, tp)
        return min(self._split_costs(kind, batch, canvas_len, block_len, tp).values())

    def round_many(self, kind: StepKind, batch, canvas, block, tp: int = 1) -> np.ndarray:
        """`round_seconds` over arrays (broadcast); `predict_many` where no measured grid can split."""
        if (StepKind(kind), tp) not in self.measured:
            return self.predict_many(kind, batch, canvas, block, tp)
        return _elementwise(lambda *a: self.round_seconds(kind, *a, tp), batch, canvas, block)

    def best_batch(self, kind: StepKind, ready: int, canvas_len: int, block_len: int, tp: int = 1) -> int:
        """How many of `ready` requests one step should take: the size of the cheapest split
        (`round_seconds`); the largest size among equally cheap ones."""
        if ready <= 1 or (StepKind(kind), tp) not in self.measured:
            return max(ready, 0)
        cost = self._split_costs(kind, ready, canvas_len, block_len, tp)
        least = min(cost.values())
        return max(k for k, c in cost.items() if c <= least * (1 + 1e-9))

    def scaled(self, scale: float) -> "LatencyModel":
        return LatencyModel(self.coefs, self.label, self.analytic, scale, self.report, self.measured)

    @classmethod
    def from_profile(cls, profile: Profile | str | Path, holdout_fraction: float = 0.2, seed: int = 0,
                     measured_points: bool | None = None) -> "LatencyModel":
        """The fit, plus the measured grid (`measured_points`; default: unless the profile is analytic)."""
        if not isinstance(profile, Profile):
            profile = Profile.load(profile)
        model = fit(profile.points, holdout_fraction, seed)
        if measured_points is None:
            measured_points = not profile.analytic
        measured = measured_grids(profile.points) if measured_points else {}
        return LatencyModel(model.coefs, profile.label, profile.analytic, 1.0, model.report, measured)


def _elementwise(fn, batch, canvas, block) -> np.ndarray:
    """fn(batch, canvas, block) on plain ints over broadcast arrays."""
    b, l, k = np.broadcast_arrays(*(np.asarray(x) for x in (batch, canvas, block)))
    out = [fn(int(x), int(y), int(z)) for x, y, z in zip(b.ravel(), l.ravel(), k.ravel())]
    return np.asarray(out, dtype=np.float64).reshape(b.shape)


def measured_grids(points: Iterable[ProfilePoint]) -> dict[tuple[StepKind, int], MeasuredSteps]:
    groups: dict[tuple[StepKind, int], list[ProfilePoint]] = {}
    for p in points:
        groups.setdefault((p.kind, p.tp), []).append(p)
    return {key: MeasuredSteps.of(pts) for key, pts in groups.items()}


def _fit_groups(points: Sequence[ProfilePoint]) -> dict[tuple[StepKind, int], tuple[float, ...]]:
    groups: dict[tuple[StepKind, int], list[ProfilePoint]] = {}
    for p in points:
        groups.setdefault((p.kind, p.tp), []).append(p)
    coefs = {}
    for key, pts in groups.items():
        x = features(key[0], [p.batch for p in pts], [p.canvas for p in pts], [p.block for p in pts])
        y = np.array([p.seconds for p in pts])
        coefs[key] = tuple(float(c) for c in _nonneg_weighted_lstsq(x, y))
    return coefs


def fit(points: Iterable[ProfilePoint | Mapping], holdout_fraction: float = 0.2, seed: int = 0) -> LatencyModel:
    """Fit on a random (1 - holdout_fraction) of the points, report the error on the rest, then
    refit on all points (the returned model; its `.report` is the held-out error)."""
    pts = [p if isinstance(p, ProfilePoint) else ProfilePoint.from_json(p) for p in points]
    if not 0.0 <= holdout_fraction < 1.0:
        raise ValueError("holdout_fraction must be in [0, 1)")
    rng = np.random.default_rng(seed)
    hold = np.zeros(len(pts), dtype=bool)
    groups: dict[tuple[StepKind, int], list[int]] = {}
    for i, p in enumerate(pts):
        groups.setdefault((p.kind, p.tp), []).append(i)
    for key, idx in groups.items():
        n_feat = features(key[0], 1, 1, 1).shape[-1]
        n_hold = min(int(round(holdout_fraction * len(idx))), len(idx) - n_feat)  # keep enough to fit
        if n_hold > 0:
            hold[rng.choice(idx, size=n_hold, replace=False)] = True
    train = [p for p, h in zip(pts, hold) if not h]
    held = [p for p, h in zip(pts, hold) if h]
    mean_err: dict[str, float] = {}
    max_err: dict[str, float] = {}
    if held:
        trial = LatencyModel(_fit_groups(train))
        for kind in StepKind:
            errs = [abs(trial.predict(p.kind, p.batch, p.canvas, p.block, p.tp) - p.seconds) / p.seconds
                    for p in held if p.kind == kind]
            if errs:
                mean_err[kind.label] = float(np.mean(errs))
                max_err[kind.label] = float(np.max(errs))
    report = FitReport(len(train), len(held), mean_err, max_err)
    return LatencyModel(_fit_groups(pts), report=report)
