"""Offline generation with the reference sampler: `python -m dilaserve_jax.generate --model tiny "prompt"`."""
from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass

from dilaserve_jax.core.cli import add_config_arguments, config_from_args, opt, returns_exit_status, setup_logging
from dilaserve_jax.kernels import IMPLEMENTATIONS

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GenerateConfig:
    prompt: str = opt(help="prompt text", positional=True)
    model: str = opt("tiny", "preset name (tiny, test) or checkpoint directory")
    gen_length: int = opt(64, "answer area in tokens")
    block_length: int = opt(32, "semi-autoregressive block length")
    threshold: float = opt(0.9, "confidence threshold tau in (0, 1]")
    temperature: float = opt(0.0, "0 = greedy; > 0 = Gumbel sampling")
    seed: int = opt(0, "sampling seed")
    attention: str | None = opt(None, "attention implementation", choices=IMPLEMENTATIONS,
                                default_text="the model's own")
    json: bool = opt(False, "print one JSON object instead of text")

    def __post_init__(self):
        if not 0 < self.threshold <= 1:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold}")
        if self.gen_length < 1 or self.block_length < 1 or self.temperature < 0:
            raise ValueError("gen_length and block_length must be positive, temperature >= 0")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dilaserve_jax.generate",
        description="Generate an answer offline with the reference (uncached) diffusion sampler and print "
                    "it with the number of denoising steps and the time taken.")
    return add_config_arguments(p, GenerateConfig)


@returns_exit_status
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    cfg = config_from_args(GenerateConfig, parser.parse_args(argv), parser)
    setup_logging(log)
    from dilaserve_jax.decoding.reference import generate
    from dilaserve_jax.models import load_model

    try:
        t0 = time.perf_counter()
        model = load_model(cfg.model, attention=cfg.attention)
        load_s = time.perf_counter() - t0
        prompt = model.tokenizer.encode(cfg.prompt)
        result = generate(model.graphdef, model.params, model.config, prompt, cfg.gen_length,
                          cfg.block_length, cfg.threshold, cfg.temperature, cfg.seed)
    except (ValueError, FileNotFoundError) as err:
        log.error(f"error: {err}")
        return 2
    text = model.tokenizer.decode(result.answer)
    if cfg.json:
        print(json.dumps({"model": model.source, "answer": text, "tokens": result.answer, "steps": result.steps,
                          "committed_per_step": result.committed_per_step, "seconds": round(result.seconds, 4)}))
    else:
        print(text)
        log.info(f"[{model.source}] {len(result.answer)} tokens in {result.steps} steps, "
                 f"{result.seconds:.3f} s (includes compilation; model load {load_s:.2f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
