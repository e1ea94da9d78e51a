"""Model configuration: one frozen dataclass and its named presets."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

_DTYPES = ("float32", "bfloat16")
_ATTENTION = ("auto", "xla", "pallas")
FAMILIES = ("llada", "dream")  # checkpoint formats (names, config.json keys); the architecture is the flags below


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and numerics of a masked-diffusion transformer (LLaDA or Dream/Qwen2 family).

    The families share one model; they differ only in the flags below (see docs/models.md).
    """

    name: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    mlp_hidden: int
    max_len: int
    mask_id: int
    eos_id: int
    pad_id: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    param_dtype: str = "float32"
    dtype: str = "float32"  # activations; norms, RoPE, softmax and logits are float32 regardless
    attention: str = "auto"  # "auto" = Pallas on GPU/TPU, XLA on CPU
    family: str = "llada"  # checkpoint format and the name GetClusterState reports
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2/Dream)
    norm_weight_after_cast: bool = False  # RMSNorm: cast back to the activation dtype, then times the
    #   weight (Qwen2/Dream order); False: times the weight in float32, then cast (LLaDA order)
    logits_shift: int = 0  # 1: the logits at position i score token i + 1 (Dream); samplers read
    #   position i - 1's row for position i > 0, and position 0 keeps its own
    bos_id: int | None = None  # from the checkpoint; informational (prompts are never prefixed)

    def __post_init__(self):
        for field in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_hidden", "max_len"):
            if getattr(self, field) <= 0:
                raise ValueError(f"ModelConfig.{field} must be positive, got {getattr(self, field)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        for field in ("mask_id", "eos_id", "pad_id"):
            if not 0 <= getattr(self, field) < self.vocab_size:
                raise ValueError(f"ModelConfig.{field}={getattr(self, field)} is outside the vocabulary [0, {self.vocab_size})")
        if self.mask_id == self.eos_id:
            raise ValueError("mask_id and eos_id must differ")
        if self.param_dtype not in _DTYPES or self.dtype not in _DTYPES:
            raise ValueError(f"param_dtype and dtype must be one of {_DTYPES}")
        if self.attention not in _ATTENTION:
            raise ValueError(f"attention must be one of {_ATTENTION}, got {self.attention!r}")
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        if self.logits_shift not in (0, 1):
            raise ValueError(f"logits_shift must be 0 or 1, got {self.logits_shift}")
        if self.bos_id is not None and not 0 <= self.bos_id < self.vocab_size:
            raise ValueError(f"ModelConfig.bos_id={self.bos_id} is outside the vocabulary [0, {self.vocab_size})")

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @property
    def num_params(self) -> int:
        d, h, kv, hd, m = self.d_model, self.n_heads, self.n_kv_heads, self.head_dim, self.mlp_hidden
        per_layer = d * h * hd * 2 + d * kv * hd * 2 + 3 * d * m + 2 * d
        if self.qkv_bias:
            per_layer += h * hd + 2 * kv * hd
        return self.n_layers * per_layer + 2 * self.vocab_size * d + d


def llada_8b() -> ModelConfig:
    """LLaDA-8B-Instruct (GSAI-ML/LLaDA-8B-Instruct config.json)."""
    return ModelConfig(
        name="llada_8b", vocab_size=126464, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32,
        head_dim=128, mlp_hidden=12288, max_len=4096, mask_id=126336, eos_id=126081, pad_id=126081,
        rope_theta=500000.0, rms_eps=1e-5, param_dtype="bfloat16", dtype="bfloat16",
    )


# What makes a config Dream-family beyond its shape: Qwen2 blocks (q/k/v biases, norm order) and
# shifted logits. Checked against Dream's modeling_dream.py / generation_utils.py (docs/models.md).
DREAM_ARCHITECTURE = dict(family="dream", qkv_bias=True, norm_weight_after_cast=True, logits_shift=1)


def dream_7b() -> ModelConfig:
    """Dream-v0-Instruct-7B (Dream-org/Dream-v0-Instruct-7B config.json: Qwen2.5-7B backbone, GQA 28/4).

    max_len is this preset's choice; a loaded checkpoint takes max_position_embeddings.
    """
    return ModelConfig(
        name="dream_7b", vocab_size=152064, d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4,
        head_dim=128, mlp_hidden=18944, max_len=2048, mask_id=151666, eos_id=151643, pad_id=151643,
        bos_id=151643, rope_theta=1000000.0, rms_eps=1e-6, param_dtype="bfloat16", dtype="bfloat16",
        **DREAM_ARCHITECTURE,
    )


def tiny() -> ModelConfig:
    """The embedded default model (character vocabulary), trained by `dilaserve_jax.tasks.train`."""
    return ModelConfig(
        name="tiny", vocab_size=128, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32,
        mlp_hidden=768, max_len=256, mask_id=2, eos_id=1, pad_id=0, rope_theta=10000.0,
    )


def test() -> ModelConfig:
    """Small enough for unit tests; character vocabulary, random weights."""
    return ModelConfig(
        name="test", vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
        mlp_hidden=128, max_len=128, mask_id=2, eos_id=1, pad_id=0, rope_theta=10000.0,
    )


test.__test__ = False  # a preset, not a test function, when imported into a test module


def test_dream() -> ModelConfig:
    """`test` with Dream's architecture flags and numerics (eps 1e-6, θ 1e6, pad = eos as in Dream)."""
    return test().replace(name="test_dream", pad_id=1, rope_theta=1000000.0, rms_eps=1e-6, **DREAM_ARCHITECTURE)


test_dream.__test__ = False

PRESETS = {"llada_8b": llada_8b, "dream_7b": dream_7b, "tiny": tiny, "test": test, "test_dream": test_dream}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}") from None
