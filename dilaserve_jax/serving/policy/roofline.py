"""Analytic roofline step-latency profiles for models and chips we cannot run here.

These are *estimates*, labelled `"analytic": true`: step time = max(FLOPs / peak, bytes / bandwidth)
per TP shard, plus a ring all-reduce term (two per layer: attention out and MLP out) and a fixed
per-step overhead. Bytes = bf16 weights (read once per step, whatever the batch) + the K/V cache
(written by a refresh for the whole canvas, read by a reuse). Logits are computed for the current
block only. Real chips reach a fraction of peak; `efficiency` scales both roofs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from dilaserve_jax.serving.policy.latency import Profile, ProfilePoint
from dilaserve_jax.core.kinds import StepKind


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    layers: int
    d_model: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp_hidden: int
    vocab: int
    bytes_per_param: int = 2  # bf16

    def __post_init__(self) -> None:
        if min(self.layers, self.d_model, self.heads, self.kv_heads, self.head_dim, self.mlp_hidden, self.vocab) < 1:
            raise ValueError(f"bad model shape {self}")

    @property
    def layer_params(self) -> int:
        d, hd = self.d_model, self.head_dim
        attn = d * self.heads * hd * 2 + d * self.kv_heads * hd * 2  # q, o + k, v
        return attn + 3 * d * self.mlp_hidden  # gate, up, down

    @property
    def step_weight_params(self) -> int:
        """Weights every step reads: all layers + LM head (embedding rows are gathered, not read)."""
        return self.layers * self.layer_params + self.vocab * self.d_model


@dataclass(frozen=True, slots=True)
class ChipSpec:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    mem_bw: float  # bytes/s
    link_bw: float  # bytes/s per direction per chip, for all-reduce
    allreduce_latency: float = 10e-6
    step_overhead: float = 300e-6  # launches / host work per step

    def __post_init__(self) -> None:
        if min(self.peak_flops, self.mem_bw, self.link_bw) <= 0:
            raise ValueError(f"bad chip spec {self}")


LLADA_8B = ModelShape("LLaDA-8B", layers=32, d_model=4096, heads=32, kv_heads=32, head_dim=128,
                      mlp_hidden=12288, vocab=126464)
A100 = ChipSpec("A100-SXM-80GB", 312e12, 2.0e12, 300e9)
H100 = ChipSpec("H100-SXM", 989e12, 3.35e12, 450e9)
H200 = ChipSpec("H200", 989e12, 4.8e12, 450e9)
CHIPS = {"a100": A100, "h100": H100, "h200": H200}


def step_seconds(kind: StepKind, batch: int, canvas: int, block: int, tp: int, model: ModelShape = LLADA_8B,
                 chip: ChipSpec = H100, efficiency: float = 1.0) -> float:
    """Roofline time of one batched step."""
    if tp < 1 or model.heads % tp or model.kv_heads % tp:
        raise ValueError(f"TP {tp} must divide the head counts of {model.name}")
    q = canvas if kind == StepKind.REFRESH else block  # query tokens per request
    tokens = batch * q
    d_attn = model.heads * model.head_dim
    flops = 2 * tokens * model.layers * model.layer_params  # linear layers
    flops += 4 * batch * q * canvas * d_attn * model.layers  # QK^T and PV
    flops += 2 * batch * block * model.d_model * model.vocab  # logits for the current block
    kv_bytes = 2 * model.layers * batch * canvas * model.kv_heads * model.head_dim * model.bytes_per_param
    bytes_ = model.step_weight_params * model.bytes_per_param + kv_bytes
    t = max(flops / (chip.peak_flops * efficiency), bytes_ / (chip.mem_bw * efficiency)) / tp
    if tp > 1:
        msg = tokens * model.d_model * model.bytes_per_param
        per_allreduce = 2 * (tp - 1) / tp * msg / chip.link_bw + chip.allreduce_latency
        t += 2 * model.layers * per_allreduce
    return t + chip.step_overhead


def analytic_profile(chip: ChipSpec | str, model: ModelShape = LLADA_8B,
                     batches: Sequence[int] = (1, 2, 4, 8, 16, 32),
                     canvases: Sequence[int] = (256, 512, 1024, 2048),
                     blocks: Sequence[int] = (32, 64), tps: Sequence[int] = (1, 2, 4, 8),
                     efficiency: float = 1.0) -> Profile:
    """A profile in the same JSON format the profiler writes, labelled analytic."""
    if isinstance(chip, str):
        chip = CHIPS[chip.lower()]
    points = []
    for tp in tps:
        for kind in StepKind:
            for b in batches:
                for l in canvases:
                    for k in blocks:
                        if k >= l:
                            continue
                        points.append(ProfilePoint(kind, b, l, k, tp, step_seconds(kind, b, l, k, tp, model, chip, efficiency)))
    label = f"analytic roofline: {model.name} on {chip.name} (not measured; efficiency {efficiency:g})"
    return Profile(label, True, chip.name, model.name, tuple(points))
