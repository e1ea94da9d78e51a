"""What a simulated model is made of: its latency profile, quality model, prior and weight size.

`llada_8b`: the analytic roofline profile of LLaDA-8B on an A100/H100/H200 (`serving.policy.roofline`,
labelled analytic) or a measured profile FILE; the published τ table (`quality.LLADA_8B_GSM8K`);
bf16 weights (2 bytes × its parameters); 4,096-token context.
`tiny`: a measured profile FILE (`python -m dilaserve_jax.bench.profile`, or the one
`python -m dilaserve_jax.bench.sim_validate` writes); the shipped eval rows (per-problem trajectories);
the shipped weights' file size; its 256-token context.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dilaserve_jax.serving.policy.latency import LatencyModel, Profile
from dilaserve_jax.serving.policy.roofline import CHIPS, LLADA_8B, analytic_profile
from dilaserve_jax.serving.policy.eval_rows import prior_from_eval_json
from dilaserve_jax.sim.executor import StepTimeModel
from dilaserve_jax.sim.quality import QualityModel

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "tiny"
MODELS = ("llada_8b", "tiny")


@dataclass
class ModelSetup:
    name: str
    profile: Profile
    latency: LatencyModel
    step_time: StepTimeModel
    quality: QualityModel
    prior: dict[float, float]
    eval_rows: list[dict]  # `tasks.eval --json` rows: the serving code's speed prior and accuracy budget
    param_bytes: float
    max_len: int
    tp_degrees: tuple[int, ...]


def load_profile(spec: str, tps: tuple[int, ...] = (1, 2, 4, 8)) -> Profile:
    """`h100`/`a100`/`h200` (analytic LLaDA-8B) or a profile JSON file."""
    if spec.lower() in CHIPS:
        return analytic_profile(spec.lower(), canvases=(256, 512, 1024, 2048, 4096), tps=tps)
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"--profile {spec}: not a chip ({', '.join(CHIPS)}) and no such file")
    return Profile.load(path)


LLADA_LENGTH_BUCKETS = (256, 512, 1024, 2048, 4096)


def setup_model(model: str, profile: str | None, *, eval_rows: str | None = None, seed: int = 0,
                noise: float | tuple[float, ...] = 0.0, overhead_s: float = 0.0, tp_degrees=(1, 2, 4, 8),
                slots: int = 8, length_buckets: tuple[int, ...] | None = None) -> ModelSetup:
    """`length_buckets`: canvas lengths the decoder compiles (a step runs one compiled step per
    bucket and block among its requests, the batch padded to a power of two, as the real decoder
    does); None: the model's default (LLaDA-8B: 256 ... 4096; tiny: the buckets of the measured
    profile); (): no padding, one step at the longest canvas."""
    if model not in MODELS:
        raise ValueError(f"--model must be one of {', '.join(MODELS)}")
    if model == "tiny":
        if profile is None:
            raise ValueError("--model tiny needs --profile FILE: a measured profile (python -m dilaserve_jax.bench."
                             "profile --out FILE, or the one python -m dilaserve_jax.bench.sim_validate writes)")
        prof = load_profile(profile, tp_degrees)
        rows_path = eval_rows or str(ASSETS / "eval.json")
        rows = json.loads(Path(rows_path).read_text())
        quality = QualityModel.from_eval_rows(rows, seed=seed)
        quality.source = rows_path
        param_bytes = float((ASSETS / "model.safetensors").stat().st_size)
        max_len = int(json.loads((ASSETS / "config.json").read_text())["max_sequence_length"])
    else:
        prof = load_profile(profile or "h100", tp_degrees)
        quality = QualityModel.from_table("llada_8b", seed=seed)
        total = LLADA_8B.layers * LLADA_8B.layer_params + 2 * LLADA_8B.vocab * LLADA_8B.d_model
        param_bytes = float(total * LLADA_8B.bytes_per_param)
        max_len = 4096
    eval_rows = quality.eval_rows()
    prior = prior_from_eval_json(eval_rows)
    if length_buckets is None:
        length_buckets = LLADA_LENGTH_BUCKETS if model == "llada_8b" else tuple(sorted({p.canvas for p in prof.points}))
    batch_buckets = tuple(2 ** k for k in range(slots.bit_length()) if 2 ** k < slots) + (slots,) if length_buckets else ()
    latency = LatencyModel.from_profile(prof)
    tps = tuple(t for t in tp_degrees if t in latency.tp_degrees)
    if not tps:
        raise ValueError(f"the profile has no fit for TP {tp_degrees} (it has {latency.tp_degrees})")
    # with the real decoder's padded shapes (buckets) a step's time is the measured point itself;
    # otherwise the fitted model (shapes between grid points)
    table = {(int(p.kind), p.tp, p.batch, p.canvas, p.block): p.seconds for p in prof.points} if length_buckets else {}
    step_time = StepTimeModel(latency, table, batch_buckets, length_buckets, noise, overhead_s)
    return ModelSetup(model, prof, latency, step_time, quality, prior, eval_rows, param_bytes, max_len, tps)
