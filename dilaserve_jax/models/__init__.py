"""Model definitions, presets, weight loading and tokenizers."""
from dilaserve_jax.models.config import ModelConfig, dream_7b, llada_8b, preset, test, tiny
from dilaserve_jax.models.llada import LayerKV, LLaDAModel, canvas_positions, forward, init_model
from dilaserve_jax.models.registry import LoadedModel, load_model
from dilaserve_jax.models.tokenizer import CharTokenizer, HFTokenizer, Tokenizer

__all__ = [
    "ModelConfig", "dream_7b", "llada_8b", "preset", "test", "tiny", "LayerKV", "LLaDAModel",
    "canvas_positions", "forward", "init_model", "LoadedModel", "load_model", "CharTokenizer",
    "HFTokenizer", "Tokenizer",
]
