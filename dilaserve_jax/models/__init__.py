"""Model definitions, presets, weight loading and tokenizers."""
from dilaserve_jax.models.config import ModelConfig, dream_7b, llada_8b, preset, test, test_dream, tiny
from dilaserve_jax.models.llada import (LayerKV, LLaDAModel, canvas_positions, forward, init_model,
                                        shift_logits)
from dilaserve_jax.models.registry import LoadedModel, load_model
from dilaserve_jax.models.tokenizer import CharTokenizer, HFTokenizer, MissingTokenizer, Tokenizer, TokenizerMissing

__all__ = [
    "ModelConfig", "dream_7b", "llada_8b", "preset", "test", "test_dream", "tiny", "LayerKV", "LLaDAModel",
    "canvas_positions", "forward", "init_model", "shift_logits", "LoadedModel", "load_model",
    "CharTokenizer", "HFTokenizer", "MissingTokenizer", "Tokenizer", "TokenizerMissing",
]
