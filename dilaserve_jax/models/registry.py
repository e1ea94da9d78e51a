"""`load_model`: one entry point from a preset name or a checkpoint directory to ready params."""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from flax import nnx

from dilaserve_jax.models import config as presets
from dilaserve_jax.models.config import ModelConfig
from dilaserve_jax.models.files import build_from_json, read_json
from dilaserve_jax.models.tokenizer import CharTokenizer, HFTokenizer, MissingTokenizer, Tokenizer, has_hf_tokenizer

ASSETS = Path(__file__).resolve().parent.parent / "assets"
CONFIG_FILE = "model_config.json"  # written next to orbax checkpoints by the training command
RANDOM_PRESETS = ("test", "test_dream")  # presets load_model builds with seeded random weights
log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    config: ModelConfig
    graphdef: Any
    params: Any
    tokenizer: Tokenizer
    source: str


def save_model_config(directory: str | Path, cfg: ModelConfig, tokenizer: str = "char") -> None:
    Path(directory).mkdir(parents=True, exist_ok=True)
    data = dataclasses.asdict(cfg) | {"tokenizer": tokenizer}
    (Path(directory) / CONFIG_FILE).write_text(json.dumps(data, indent=1))


def _read_model_config(directory: Path) -> tuple[ModelConfig, str]:
    data = read_json(directory / CONFIG_FILE)
    tokenizer = data.pop("tokenizer", "char")
    return build_from_json(ModelConfig, data, directory / CONFIG_FILE), tokenizer


def _tokenizer_for(directory: Path | None, cfg: ModelConfig, kind: str | None = None) -> Tokenizer:
    """tokenizer.json, or vocab.json + merges.txt (Dream ships these), else the character vocabulary
    for a 128-token model, else a MissingTokenizer: the model serves token-id prompts only."""
    if directory is not None and kind != "char" and has_hf_tokenizer(directory):
        return HFTokenizer(directory, mask_id=cfg.mask_id, eos_id=cfg.eos_id, pad_id=cfg.pad_id)
    if cfg.vocab_size == CharTokenizer.vocab_size:
        return CharTokenizer()
    missing = MissingTokenizer(directory if directory is not None else cfg.name, vocab_size=cfg.vocab_size,
                               mask_id=cfg.mask_id, eos_id=cfg.eos_id, pad_id=cfg.pad_id)
    log.warning("%s", missing.message)
    return missing


def load_model(source: str | Path, *, param_dtype: str | None = None, attention: str | None = None,
               place: Callable | None = None, step: int | None = None, seed: int = 0) -> LoadedModel:
    """Load a model from a preset name, an HF LLaDA or Dream directory, or an orbax training directory.

    Presets: "tiny" (the trained embedded model), "test" / "test_dream" (random weights, seeded).
    Directories: config.json + *.safetensors (LLaDA or Dream format, told apart by config.json's
    model_type / architectures), or model_config.json + orbax steps (latest, or `step`).
    param_dtype/attention override the stored configuration.
    """
    from dilaserve_jax.models.hf import config_from_hf, load_hf_params

    overrides = {k: v for k, v in (("param_dtype", param_dtype), ("attention", attention)) if v is not None}
    name = str(source)
    if name == "tiny":
        directory = ASSETS / "tiny"
        if not (directory / "config.json").exists():
            raise FileNotFoundError(f"the embedded tiny model is missing from {directory}; "
                                    "train it with `python -m dilaserve_jax.tasks.train`")
        return load_model(directory, param_dtype=param_dtype, attention=attention, place=place)
    if name in presets.PRESETS and not Path(name).exists():
        cfg = presets.preset(name).replace(**overrides)
        if name not in RANDOM_PRESETS:
            raise ValueError(f"preset {name!r} has no embedded weights; pass a checkpoint directory "
                             "(the preset shape with random weights is available through models.init_model)")
        from dilaserve_jax.models.llada import init_model

        graphdef, params = nnx.split(init_model(cfg, seed))
        return LoadedModel(cfg, graphdef, params, _tokenizer_for(None, cfg), f"preset:{name} (random, seed {seed})")
    directory = Path(name)
    if not directory.is_dir():
        raise FileNotFoundError(f"{name!r} is neither a preset ({', '.join(presets.PRESETS)}) nor a directory")
    if (directory / "config.json").exists():
        cfg = config_from_hf(directory, **overrides)
        graphdef, params = load_hf_params(directory, cfg, place=place)
        tok_kind = read_json(directory / "config.json").get("dilaserve_tokenizer")
        return LoadedModel(cfg, graphdef, params, _tokenizer_for(directory, cfg, tok_kind), f"hf:{directory}")
    if (directory / CONFIG_FILE).exists():
        from dilaserve_jax.models.checkpoint import restore_params
        from dilaserve_jax.models.hf import abstract_params

        cfg, tok_kind = _read_model_config(directory)
        cfg = cfg.replace(**overrides)
        graphdef, abstract = abstract_params(cfg)
        restored_step, params = restore_params(directory, abstract, step)
        return LoadedModel(cfg, graphdef, params, _tokenizer_for(directory, cfg, tok_kind),
                           f"orbax:{directory}@{restored_step}")
    raise FileNotFoundError(f"{directory} holds neither config.json (HF LLaDA or Dream) nor {CONFIG_FILE} (orbax)")
