"""The two Hugging Face checkpoint families: tensor names and config.json, both ways.

One table per family maps HF tensor names onto the one model's parameter paths (models/llada.py).
LLaDA: GSAI-ML/LLaDA-8B-Instruct. Dream: Dream-org/Dream-v0-{Base,Instruct}-7B, whose keys and
config follow its modeling_dream.py / configuration_dream.py (Qwen2 names; see docs/models.md).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from dilaserve_jax.models.config import DREAM_ARCHITECTURE, ModelConfig


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: names the key and the shapes involved."""


@dataclass(frozen=True, slots=True)
class CheckpointFormat:
    """HF tensor names of one family: top-level tensors, and per-layer names under `layer_prefix`.

    Values are (our parameter path or (module, leaf) inside a block, transpose torch [out, in]?).
    """

    family: str
    top: dict[str, tuple[tuple, bool]]
    layer_prefix: str  # with {i} for the layer index
    layer: dict[str, tuple[tuple, bool]]

    def __post_init__(self):
        if "{i}" not in self.layer_prefix:
            raise ValueError("layer_prefix needs an {i} placeholder")

    @property
    def _layer_key(self) -> re.Pattern:
        head, tail = self.layer_prefix.split("{i}")
        return re.compile(f"^{re.escape(head)}(\\d+){re.escape(tail)}(.+)$")

    def to_param(self, key: str) -> tuple[tuple, bool] | None:
        """HF tensor name -> (parameter path, transpose?), or None if the name is not ours."""
        if key in self.top:
            return self.top[key]
        m = self._layer_key.match(key)
        if m and m.group(2) in self.layer:
            sub, transpose = self.layer[m.group(2)]
            return ("blocks", int(m.group(1)), *sub), transpose
        return None

    def to_key(self, path: tuple) -> tuple[str, bool]:
        """Parameter path -> (HF tensor name, transpose?)."""
        for key, (p, transpose) in self.top.items():
            if p == tuple(path):
                return key, transpose
        if path[0] == "blocks":
            for name, (sub, transpose) in self.layer.items():
                if sub == tuple(path[2:]):
                    return self.layer_prefix.format(i=path[1]) + name, transpose
        raise KeyError(f"parameter {path} has no {self.family} checkpoint name")


def _llada_layer() -> dict[str, tuple[tuple, bool]]:
    layer = {f"{n}.weight": ((n, "weight"), False) for n in ("attn_norm", "ff_norm")}
    layer |= {f"{n}.weight": ((n, "kernel"), True)
              for n in ("q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out")}
    return layer


def _dream_layer() -> dict[str, tuple[tuple, bool]]:
    layer = {"input_layernorm.weight": (("attn_norm", "weight"), False),
             "post_attention_layernorm.weight": (("ff_norm", "weight"), False),
             "self_attn.o_proj.weight": (("attn_out", "kernel"), True),
             "mlp.gate_proj.weight": (("ff_proj", "kernel"), True),
             "mlp.up_proj.weight": (("up_proj", "kernel"), True),
             "mlp.down_proj.weight": (("ff_out", "kernel"), True)}
    for n in ("q_proj", "k_proj", "v_proj"):
        layer[f"self_attn.{n}.weight"] = ((n, "kernel"), True)
        layer[f"self_attn.{n}.bias"] = ((n, "bias"), False)
    return layer


LLADA = CheckpointFormat(
    family="llada",
    top={"model.transformer.wte.weight": (("wte",), False),
         "model.transformer.ln_f.weight": (("ln_f", "weight"), False),
         "model.transformer.ff_out.weight": (("lm_head", "kernel"), True)},
    layer_prefix="model.transformer.blocks.{i}.", layer=_llada_layer())

DREAM = CheckpointFormat(
    family="dream",
    top={"model.embed_tokens.weight": (("wte",), False),
         "model.norm.weight": (("ln_f", "weight"), False),
         "lm_head.weight": (("lm_head", "kernel"), True)},
    layer_prefix="model.layers.{i}.", layer=_dream_layer())

FORMATS = {f.family: f for f in (LLADA, DREAM)}


def detect_family(raw: dict, path: Path | str = "config.json") -> str:
    """Which family a config.json describes: model_type / architectures, else LLaDA's own keys."""
    model_type = str(raw.get("model_type", "")).lower()
    architectures = [str(a).lower() for a in raw.get("architectures") or []]
    if model_type == "dream" or any(a.startswith("dream") for a in architectures):
        return "dream"
    if model_type == "llada" or any(a.startswith("llada") for a in architectures) or \
            ("d_model" in raw and "n_layers" in raw):
        return "llada"
    raise CheckpointError(f"{path}: model_type {raw.get('model_type')!r} / architectures "
                          f"{raw.get('architectures')} is neither LLaDA nor Dream (the supported families)")


def _required(raw: dict, key: str, path) -> object:
    if raw.get(key) is None:
        raise CheckpointError(f"{path}: config.json has no {key!r}")
    return raw[key]


def _single_id(raw: dict, key: str, path) -> int | None:
    value = raw.get(key)
    if isinstance(value, list):
        if len(value) != 1:
            raise CheckpointError(f"{path}: {key} {value} lists several ids; one is supported")
        value = value[0]
    return None if value is None else int(value)


def llada_config(raw: dict, name: str, path) -> dict:
    if raw.get("include_bias") or raw.get("weight_tying"):
        raise CheckpointError("checkpoints with biases or tied embeddings are not supported")
    d_model, n_heads = raw["d_model"], raw["n_heads"]
    return dict(
        name=name, vocab_size=raw.get("embedding_size") or raw["vocab_size"],
        d_model=d_model, n_layers=raw["n_layers"], n_heads=n_heads,
        n_kv_heads=raw.get("n_kv_heads") or n_heads, head_dim=raw.get("head_dim") or d_model // n_heads,
        mlp_hidden=raw.get("mlp_hidden_size") or int(raw.get("mlp_ratio", 4) * d_model),
        max_len=raw.get("max_sequence_length", 4096),
        mask_id=raw.get("mask_token_id", 126336), eos_id=raw.get("eos_token_id", 126081),
        pad_id=raw.get("pad_token_id", raw.get("eos_token_id", 126081)),
        rope_theta=float(raw.get("rope_theta", 10000.0)), rms_eps=float(raw.get("rms_norm_eps", 1e-5)))


def dream_config(raw: dict, name: str, path) -> dict:
    """Every id comes from config.json (Dream's generation_config.json has mask_token_id null)."""
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{path}: hidden_act {raw['hidden_act']!r} is not supported (Dream uses silu)")
    if raw.get("rope_scaling"):
        raise CheckpointError(f"{path}: rope_scaling {raw['rope_scaling']} is not supported")
    if raw.get("use_sliding_window"):
        raise CheckpointError(f"{path}: sliding-window attention is not supported")
    d_model, n_heads = int(_required(raw, "hidden_size", path)), int(_required(raw, "num_attention_heads", path))
    eos = _single_id(raw, "eos_token_id", path)
    if eos is None:
        raise CheckpointError(f"{path}: config.json has no 'eos_token_id'")
    pad = _single_id(raw, "pad_token_id", path)
    return dict(
        name=name, vocab_size=int(_required(raw, "vocab_size", path)), d_model=d_model,
        n_layers=int(_required(raw, "num_hidden_layers", path)), n_heads=n_heads,
        n_kv_heads=int(raw.get("num_key_value_heads") or n_heads),
        head_dim=int(raw.get("head_dim") or d_model // n_heads),
        mlp_hidden=int(_required(raw, "intermediate_size", path)),
        max_len=int(raw.get("max_position_embeddings", 32768)),
        mask_id=int(_required(raw, "mask_token_id", path)), eos_id=eos, pad_id=eos if pad is None else pad,
        bos_id=_single_id(raw, "bos_token_id", path),
        # Defaults are configuration_dream.py's; the released config.json sets both explicitly.
        rope_theta=float(raw.get("rope_theta", 10000.0)), rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
        **DREAM_ARCHITECTURE)


def raw_config(cfg: ModelConfig) -> dict:
    """config.json for cfg in its family's format (what save_hf_checkpoint writes)."""
    if cfg.family == "llada":
        if cfg.qkv_bias or cfg.norm_weight_after_cast or cfg.logits_shift:
            raise ValueError("the LLaDA format cannot express q/k/v biases, the Qwen2 norm order or shifted logits")
        return {
            "model_type": "llada", "d_model": cfg.d_model, "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim, "n_layers": cfg.n_layers, "mlp_hidden_size": cfg.mlp_hidden,
            "vocab_size": cfg.vocab_size, "embedding_size": cfg.vocab_size, "max_sequence_length": cfg.max_len,
            "mask_token_id": cfg.mask_id, "eos_token_id": cfg.eos_id, "pad_token_id": cfg.pad_id,
            "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_eps, "include_bias": False,
            "weight_tying": False, "torch_dtype": cfg.param_dtype, "dilaserve_name": cfg.name,
        }
    arch = {k: getattr(cfg, k) for k in DREAM_ARCHITECTURE}
    if arch != DREAM_ARCHITECTURE:
        raise ValueError(f"the Dream format needs {DREAM_ARCHITECTURE}, the config has {arch}")
    raw = {
        "architectures": ["DreamModel"], "model_type": "Dream", "hidden_act": "silu",
        "hidden_size": cfg.d_model, "intermediate_size": cfg.mlp_hidden, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "max_position_embeddings": cfg.max_len, "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": None, "use_sliding_window": False,
        "tie_word_embeddings": False, "mask_token_id": cfg.mask_id, "eos_token_id": cfg.eos_id,
        "pad_token_id": cfg.pad_id, "bos_token_id": cfg.bos_id,
        "torch_dtype": cfg.param_dtype, "dilaserve_name": cfg.name,
    }
    if cfg.head_dim != cfg.d_model // cfg.n_heads:  # Dream derives it; write it when it differs
        raw["head_dim"] = cfg.head_dim
    return raw
